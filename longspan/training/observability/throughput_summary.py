"""The run's steady-state throughput: log intervals recorded by the training log, summarized at the end."""

from __future__ import annotations

from typing import Optional

from longspan.core.logging import get_world_size
from longspan.training.state import GlobalState
from longspan.planner.peak_flops import format_mfu, mfu, peak_flops_per_device


def record_log_interval(global_state: GlobalState, iteration: int, num_iterations: int, seconds: float,
                        tokens: int, flops: float) -> None:
    """Record one log interval (interval timer seconds, tokens, model FLOPs) for ``run_throughput_summary``."""
    intervals = getattr(global_state, "_log_intervals", None)
    if intervals is None:
        intervals = global_state._log_intervals = []
    intervals.append((iteration - num_iterations + 1, iteration, float(seconds), int(tokens), float(flops)))


def run_throughput_summary(global_state: GlobalState) -> Optional[str]:
    """'iterations a-b: N tokens/s/device, x TFLOP/s/device, MFU y%' over this run's log intervals after the
    first (which holds start-up and compile warm-up), or the first when it is the only one; None without any."""
    intervals = getattr(global_state, "_log_intervals", None) or []
    steady = intervals[1:] or intervals
    seconds = sum(i[2] for i in steady)
    if seconds <= 0:
        return None
    world = get_world_size()
    tokens, flops = sum(i[3] for i in steady), sum(i[4] for i in steady)
    text = f"iterations {steady[0][0]}-{steady[-1][1]}: {tokens / seconds / world:.0f} tokens/s/device"
    if flops > 0:
        per_device = flops / seconds / world
        value = mfu(per_device, peak_flops_per_device(getattr(global_state, "device", None)))
        text += f", {per_device / 1e12:.3g} TFLOP/s/device"
        if value is not None:
            text += f", MFU {format_mfu(value)}"
    return text
