"""Energy counters for ``logger.log_energy``: joules used per log interval, summed over ranks.

Megatron's EnergyMonitor reads each GPU's NVML energy counter and all-reduces each lap. longspan reads,
in order of preference, the first counter this machine exposes:

- CUDA with ``pynvml``: ``nvmlDeviceGetTotalEnergyConsumption`` of this rank's GPU (millijoules since load);
- CUDA without it: ``torch.cuda.power_draw()`` (milliwatts, the sensor's recent average) times the seconds
  since the previous read, a coarser estimate;
- CPU on Linux: the RAPL package counters ``<powercap root>/intel-rapl:<n>/energy_uj`` (microjoules, wrapping
  at ``max_energy_range_uj``). These files are often readable only by root, or absent in containers.

Without any readable counter ``build_energy_monitor`` returns None and start-up lists the field as not
applicable on this machine.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

# Where Linux exposes the RAPL counters; a module attribute so tests can point it at a fake tree.
POWERCAP_ROOT = Path("/sys/class/powercap")
_PACKAGE_ZONE = re.compile(r"^intel-rapl:\d+$")  # packages only: their sub-zones (core, dram) count within them


class RaplCounter:
    """The sum of the RAPL package counters under ``root``, in joules, unwrapped across wraparounds."""

    def __init__(self, zones: list[Path]) -> None:
        self.zones = zones
        self.ranges = [int((z / "max_energy_range_uj").read_text()) for z in zones]
        self._last = [self._read_uj(z) for z in zones]
        self._total_uj = 0

    @staticmethod
    def _read_uj(zone: Path) -> int:
        return int((zone / "energy_uj").read_text())

    @classmethod
    def find(cls, root: Optional[Path] = None) -> Optional["RaplCounter"]:
        """A counter over every package zone under ``root`` (POWERCAP_ROOT), or None when none is readable."""
        root = Path(POWERCAP_ROOT if root is None else root)
        try:
            zones = sorted(p for p in root.iterdir() if _PACKAGE_ZONE.match(p.name))
        except OSError:
            return None
        if not zones:
            return None
        try:
            return cls(zones)
        except (OSError, ValueError):  # root-only files, or garbage in them
            return None

    def joules(self) -> float:
        """Joules used since this counter was created."""
        for i, zone in enumerate(self.zones):
            now = self._read_uj(zone)
            delta = now - self._last[i]
            if delta < 0:  # the counter wrapped at max_energy_range_uj
                delta += self.ranges[i] + 1
            self._total_uj += delta
            self._last[i] = now
        return self._total_uj / 1e6


class _NvmlCounter:
    """This rank's GPU energy counter through pynvml (millijoules since the driver loaded)."""

    def __init__(self, device_index: int) -> None:
        # optional dependency: NVIDIA's management library, only on CUDA machines
        import pynvml

        pynvml.nvmlInit()
        self._read = pynvml.nvmlDeviceGetTotalEnergyConsumption
        self._handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
        self._start = self._read(self._handle)

    def joules(self) -> float:
        return (self._read(self._handle) - self._start) / 1000.0


class _PowerDrawCounter:
    """``torch.cuda.power_draw()`` (mW) integrated over the time between reads."""

    def __init__(self, device_index: int) -> None:
        self._device = device_index
        torch.cuda.power_draw(device_index)  # raises when the sensor cannot be read
        self._last_time = time.monotonic()
        self._total = 0.0

    def joules(self) -> float:
        now = time.monotonic()
        self._total += torch.cuda.power_draw(self._device) / 1000.0 * (now - self._last_time)
        self._last_time = now
        return self._total


def find_counter(device: Optional[torch.device] = None) -> Optional[Callable[[], float]]:
    """A ``() -> joules so far`` reader of the first counter this machine exposes for ``device``, or None."""
    if device is not None and device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        for build in (_NvmlCounter, _PowerDrawCounter):
            try:
                return build(index).joules
            except Exception:  # noqa: BLE001 - no pynvml / no sensor: try the next counter
                continue
        return None
    rapl = RaplCounter.find()
    return rapl.joules if rapl is not None else None


class EnergyMonitor:
    """Energy of each log interval: ``lap()`` returns (joules summed over all ranks, seconds) since the
    previous lap (or since creation). Collective when torch.distributed is initialized: call on every rank."""

    def __init__(self, counter: Callable[[], float], device: Optional[torch.device] = None) -> None:
        self._counter = counter
        self._device = device if device is not None and device.type == "cuda" else torch.device("cpu")
        self._last_joules = counter()
        self._last_time = time.monotonic()

    def lap(self) -> tuple[float, float]:
        joules, now = self._counter(), time.monotonic()
        lap_joules, seconds = joules - self._last_joules, now - self._last_time
        self._last_joules, self._last_time = joules, now
        if dist.is_available() and dist.is_initialized():
            total = torch.tensor([lap_joules], dtype=torch.float64, device=self._device)
            dist.all_reduce(total)
            lap_joules = float(total.item())
        return lap_joules, seconds


def build_energy_monitor(device: Optional[torch.device] = None) -> Optional[EnergyMonitor]:
    """An EnergyMonitor when every rank has a readable counter, else None (on every rank alike)."""
    counter = find_counter(device)
    if dist.is_available() and dist.is_initialized():
        on_device = device if device is not None and device.type == "cuda" else torch.device("cpu")
        have = torch.tensor([1 if counter is not None else 0], dtype=torch.int64, device=on_device)
        dist.all_reduce(have, op=dist.ReduceOp.MIN)
        if int(have.item()) == 0:
            return None
    return EnergyMonitor(counter, device) if counter is not None else None


def interval_energy(monitor: Optional[EnergyMonitor], iterations: int, world_size: int) -> Optional[dict[str, float]]:
    """Megatron's two numbers for a log interval: energy per GPU per iteration (J) and power per GPU (W)."""
    if monitor is None:
        return None
    joules, seconds = monitor.lap()
    per_gpu = joules / max(1, world_size)
    return {"energy_per_gpu_j_per_iter": per_gpu / max(1, iterations),
            "power_per_gpu_w": per_gpu / seconds if seconds > 0 else 0.0}
