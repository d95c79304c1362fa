"""Device peak FLOP/s and model FLOPs utilisation (achieved model FLOP/s per device over that peak), for the
planner's step-time estimates and the training log's MFU.

``peak_flops_per_device()`` is, in order: the ``LONGSPAN_PEAK_TFLOPS`` environment variable (TFLOP/s of one
device, for the run's precision), the table below by the CUDA device's name (dense bf16 tensor-core peaks of
the SXM parts, no sparsity), or on a CPU the fastest dense matmul measured once per process (float32 and
bfloat16, the best of a few short runs each, so a moment of load from other processes does not lower it; a
bf16 run on a CPU with bf16 instructions is measured against the bf16 rate, as GPU runs are against the bf16
datasheet peak). MFU on a CPU is therefore relative to what this machine's matmul reaches with the current
thread count, not a datasheet number. Unknown accelerators give None (MFU not reported; set the variable).

MFU above 100% means the peak is wrong (a CPU measured under heavy load, a too small ``LONGSPAN_PEAK_TFLOPS``):
``format_mfu`` then says ``n/a (peak too low)`` and ``reported_mfu`` gives None (metrics.jsonl), never a
number above 100%.

Model FLOPs are Megatron's formula (``longspan.planner.flops.num_floating_point_operations``); recompute is not
counted; a PEFT run counts the FLOPs of a frozen base plus its adapters.
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


#: matrix size, dtypes, runs and seconds per run of the CPU peak measurement (about 0.5 s in all)
CPU_PEAK_MATMUL_SIZE = 1024
CPU_PEAK_DTYPES = (torch.float32, torch.bfloat16)
CPU_PEAK_RUNS = 3
CPU_PEAK_SECONDS_PER_RUN = 0.05


def _matmul_tflops(size: int, dtype: torch.dtype, seconds: float) -> float:
    """TFLOP/s of back-to-back ``size`` x ``size`` matmuls in ``dtype`` over at least ``seconds``."""
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    count, start = 0, time.perf_counter()
    while True:
        torch.mm(a, b)
        count += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return 2.0 * size**3 * count / elapsed / 1e12


@functools.lru_cache(maxsize=8)
def measured_cpu_tflops(threads: int) -> float:
    """The fastest dense matmul TFLOP/s of this CPU with ``threads`` intra-op threads (measured once per
    process): the best of ``CPU_PEAK_RUNS`` short runs in each of ``CPU_PEAK_DTYPES``, after a warm-up matmul."""
    best = 0.0
    for dtype in CPU_PEAK_DTYPES:
        _matmul_tflops(CPU_PEAK_MATMUL_SIZE, dtype, 0.0)  # warm-up: first-call set-up and page faults
        for _ in range(CPU_PEAK_RUNS):
            best = max(best, _matmul_tflops(CPU_PEAK_MATMUL_SIZE, dtype, CPU_PEAK_SECONDS_PER_RUN))
    return best


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
    """Achieved / peak as a fraction, or None when either is unknown (may exceed 1 when the peak is too low:
    report it through ``format_mfu`` / ``reported_mfu``)."""
    if not flops_per_second_per_device or not peak:
        return None
    return flops_per_second_per_device / peak


#: what the log line and the end-of-run summary say instead of an MFU above 100%
MFU_ABOVE_PEAK = "n/a (peak too low)"


def reported_mfu(value: Optional[float]) -> Optional[float]:
    """``value`` when it is a believable utilisation (at most 1), else None."""
    return value if value is not None and value <= 1.0 else None


def format_mfu(value: float) -> str:
    """'41.2%', or ``MFU_ABOVE_PEAK`` when the achieved FLOP/s exceed the peak (the peak is wrong)."""
    return f"{100.0 * value:.1f}%" if value <= 1.0 else MFU_ABOVE_PEAK
