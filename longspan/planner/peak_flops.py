"""Device peak FLOP/s and model FLOPs utilisation (achieved model FLOP/s per device over that peak), for the
planner's step-time estimates and the training log's MFU.

``peak_flops_per_device()`` is, in order: the ``LONGSPAN_PEAK_TFLOPS`` environment variable (TFLOP/s of one
device, for the run's precision), the table below by the CUDA device's name (dense bf16 tensor-core peaks of
the SXM parts, no sparsity), or on a CPU a short float32 matmul measured once per process (so MFU on a CPU
is relative to what this machine's matmul reaches with the current thread count, not a datasheet number).
Unknown accelerators give None (MFU not reported; set the variable).

Model FLOPs are Megatron's formula (``longspan.planner.flops.num_floating_point_operations``); recompute is not counted.
"""

from __future__ import annotations

import functools
import os
import time
from typing import Optional

import torch

from longspan.core.errors import ConfigError

PEAK_TFLOPS_ENV = "LONGSPAN_PEAK_TFLOPS"

#: dense bf16 peak TFLOP/s per device kind (vendor datasheets, SXM parts, without sparsity)
PEAK_BF16_TFLOPS: dict[str, float] = {
    "h100": 989.4,
    "h200": 989.4,
    "a100": 312.0,
    "b200": 2250.0,
}


def device_kind(device: Optional[torch.device] = None) -> str:
    """'h100', 'h200', 'a100', 'b200' from a CUDA device's name, 'cpu', or the lower-case CUDA name."""
    device = torch.device(device) if device is not None else (
        torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device).lower()
    for kind in PEAK_BF16_TFLOPS:
        if kind in name:
            return kind
    return name


@functools.lru_cache(maxsize=8)
def measured_cpu_tflops(threads: int, size: int = 512, seconds: float = 0.2) -> float:
    """float32 matmul TFLOP/s of this CPU with ``threads`` intra-op threads (measured once per process)."""
    a = torch.randn(size, size)
    b = torch.randn(size, size)
    torch.mm(a, b)
    count, start = 0, time.perf_counter()
    while True:
        torch.mm(a, b)
        count += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return 2.0 * size**3 * count / elapsed / 1e12


def peak_flops_per_device(device: Optional[torch.device] = None) -> Optional[float]:
    """Peak FLOP/s of one device (see the module docstring), or None when unknown."""
    raw = os.environ.get(PEAK_TFLOPS_ENV)
    if raw:
        try:
            value = float(raw)
        except ValueError:
            value = -1.0
        if not value > 0:
            raise ConfigError(f"{PEAK_TFLOPS_ENV}={raw!r} is not a positive number of TFLOP/s per device")
        return value * 1e12
    kind = device_kind(device)
    if kind == "cpu":
        return measured_cpu_tflops(torch.get_num_threads()) * 1e12
    tflops = PEAK_BF16_TFLOPS.get(kind)
    return tflops * 1e12 if tflops else None


def mfu(flops_per_second_per_device: Optional[float], peak: Optional[float]) -> Optional[float]:
    """Achieved / peak as a fraction, or None when either is unknown."""
    if not flops_per_second_per_device or not peak:
        return None
    return flops_per_second_per_device / peak
