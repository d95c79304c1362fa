"""Runtime and throughput reports (Megatron Bridge's ``report_runtime`` / ``report_throughput``)."""

from __future__ import annotations

import time
from typing import Any

from longspan.core.errors import ConfigError
from longspan.core.logging import get_world_size, print_rank_0
from longspan.training.state import TrainState

_TIME_UNITS = {"seconds": 1, "minutes": 60, "hours": 60 * 60, "days": 60 * 60 * 24}


def report_runtime(
    train_state: TrainState, start_time: int, seq_length: int, train_iters: int, time_unit: str = "seconds"
) -> dict:
    """Estimated training time: elapsed time extrapolated to ``train_iters``.

    Returns ``time/remaining_estimate`` (omitted before the first step), ``time/tokens``
    (consumed samples x seq_length), ``time/samples``, ``time/batches`` (steps) and ``time/total`` (elapsed),
    times in ``time_unit`` (seconds, minutes, hours or days).
    """
    if time_unit not in _TIME_UNITS:
        raise ConfigError(f"time unit {time_unit!r} is not valid; use one of {', '.join(_TIME_UNITS)}")
    divider = _TIME_UNITS[time_unit]
    elapsed = time.time() - start_time
    metrics: dict[str, float] = {}
    if train_state.step > 0 and train_iters:
        fraction_done = train_state.step / train_iters
        metrics["time/remaining_estimate"] = elapsed / fraction_done * (1 - fraction_done) / divider
    metrics["time/tokens"] = train_state.consumed_train_samples * seq_length
    metrics["time/samples"] = train_state.consumed_train_samples
    metrics["time/batches"] = train_state.step
    metrics["time/total"] = elapsed / divider
    return metrics


def report_throughput(
    train_config: Any, iteration: int, seq_length: int, history_wct: list, window_size: int
) -> dict:
    """Rolling throughput over the last ``window_size`` iterations.

    ``history_wct`` holds the wall-clock time (seconds, any origin) at the end of each iteration; the window
    spans ``window_size`` entries, i.e. ``window_size - 1`` iterations. Returns {} until the window is full
    or when its time span is not positive.

    Returns ``throughput/batches_per_sec``, ``throughput/samples_per_sec``, ``throughput/tokens_per_sec``,
    their ``throughput/device/...`` counterparts (divided by the world size), and
    ``throughput/micro_batch_size`` / ``throughput/global_batch_size``.
    """
    if window_size < 2 or len(history_wct) < window_size:
        return {}
    elapsed_wct = history_wct[-1] - history_wct[-window_size]
    if elapsed_wct <= 0:
        print_rank_0(f"Warning: elapsed_wct is {elapsed_wct}, skipping throughput calculation at iteration {iteration}")
        return {}
    world_size = get_world_size()
    batches = window_size - 1
    samples = batches * train_config.global_batch_size
    tokens = samples * seq_length
    metrics = {
        "throughput/batches_per_sec": batches / elapsed_wct,
        "throughput/samples_per_sec": samples / elapsed_wct,
        "throughput/device/batches_per_sec": batches / elapsed_wct / world_size,
        "throughput/device/samples_per_sec": samples / elapsed_wct / world_size,
        "throughput/micro_batch_size": train_config.micro_batch_size,
        "throughput/global_batch_size": train_config.global_batch_size,
    }
    if tokens > 0:
        metrics["throughput/tokens_per_sec"] = tokens / elapsed_wct
        metrics["throughput/device/tokens_per_sec"] = tokens / elapsed_wct / world_size
    return metrics


