"""GPU memory reporting and memory-history recording (CUDA only; safe no-ops on CPU)."""

from __future__ import annotations

import math
import os
import pickle
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from longspan.config.schema.infra import ProfilingConfig
from longspan.core.logging import get_logger, get_rank, print_rank_0
from longspan.training.utils.comm import collective_device, dist_ready, group_size

logger = get_logger(__name__)

# torch.cuda.memory_stats() key -> logged name ("bytes" becomes "gigabytes" in report_memory).
MEMORY_KEYS: dict[str, str] = {
    "allocated_bytes.all.current": "mem-allocated-bytes",
    "active_bytes.all.current": "mem-active-bytes",
    "inactive_split_bytes.all.current": "mem-inactive-bytes",
    "reserved_bytes.all.current": "mem-reserved-bytes",
    "allocated_bytes.all.peak": "mem-max-allocated-bytes",
    "active_bytes.all.peak": "mem-max-active-bytes",
    "inactive_split_bytes.all.peak": "mem-max-inactive-bytes",
    "reserved_bytes.all.peak": "mem-max-reserved-bytes",
    "num_alloc_retries": "mem-alloc-retires",
    "allocation.all.current": "mem-allocated-count",
}


def _five_significant_digits(x: float) -> float:
    if x == 0:
        return 0.0
    return round(x, -int(math.floor(math.log10(abs(x)))) + 4)


def report_memory(memory_keys: Optional[dict[str, str]]) -> dict:
    """CUDA caching-allocator statistics of this process.

    Args:
        memory_keys: ``torch.cuda.memory_stats()`` key -> logged name; ``MEMORY_KEYS`` when None or empty.
            Byte counts are converted to gigabytes (1e9 bytes, 5 significant digits) and ``bytes`` in the
            name becomes ``gigabytes``; counters are reported as they are.

    Returns:
        ``{name: value}``; empty when CUDA is not in use (CPU runs have no allocator statistics).
    """
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return {}
    stats = torch.cuda.memory_stats()
    report: dict[str, Union[int, float]] = {}
    for torch_name, name in (memory_keys or MEMORY_KEYS).items():
        if torch_name not in stats:
            continue
        if "bytes" in torch_name:
            report[name.replace("bytes", "gigabytes")] = _five_significant_digits(stats[torch_name] / 1.0e9)
        else:
            report[name] = stats[torch_name]
    return report


def reduce_max_memory_across_pp_group(
    memory_report: dict[str, Union[int, float]],
    pp_group: Any,
) -> dict[str, Union[int, float]]:
    """Per-metric MAX of ``memory_report`` over the pipeline-parallel group.

    The first pipeline stage usually holds the peak memory, but metrics are written on the last rank; one
    all-reduce makes the written values the pipeline-wide peaks. Integer counters stay ints. Returns the
    input unchanged when not distributed, the group has one rank (or is None), or the report is empty.
    Every rank of ``pp_group`` must call this with the same keys.
    """
    if not memory_report or pp_group is None or not dist_ready() or group_size(pp_group) <= 1:
        return memory_report
    keys = list(memory_report)
    values = torch.tensor(
        [float(memory_report[k]) for k in keys], dtype=torch.float64, device=collective_device(pp_group)
    )
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=pp_group)
    reduced: dict[str, Union[int, float]] = {}
    for key, value in zip(keys, values.tolist()):
        original = memory_report[key]
        is_int = isinstance(original, int) and not isinstance(original, bool)
        reduced[key] = int(value) if is_int else value
    return reduced


def start_memory_history_recording(profiling: Optional[ProfilingConfig]) -> None:
    """Record CUDA allocator history so memory snapshots show a timeline and call sites.

    Call before building the model so every allocation is captured. Active only when
    ``profiling.record_memory_history`` is set and this rank is in ``profiling.profile_ranks``; then an
    out-of-memory error also dumps ``{memory_snapshot_path stem}_oom_rank-{rank}{ext}``. Without CUDA this
    logs one line and returns.
    """
    if profiling is None or not profiling.record_memory_history:
        return
    rank = get_rank()
    if rank not in list(profiling.profile_ranks or [0]):
        return
    if not torch.cuda.is_available():
        logger.info(f"profiling.record_memory_history is set but CUDA is not available: rank {rank} records nothing")
        return
    torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python", max_entries=100_000)
    snapshot_path = profiling.memory_snapshot_path

    def _dump_on_oom(device: int, alloc: int, device_alloc: int, device_free: int) -> None:
        base, ext = os.path.splitext(snapshot_path)
        filename = f"{base}_oom_rank-{rank}{ext}"
        with open(filename, "wb") as f:
            pickle.dump(torch.cuda.memory._snapshot(), f)
        logger.info(f"[OOM] rank {rank} saved memory snapshot to {filename}")

    torch._C._cuda_attach_out_of_memory_observer(_dump_on_oom)
    print_rank_0(f"Memory history recording enabled (rank {rank}); snapshots go to '{snapshot_path}'.")


def dump_memory_snapshot(profiling: ProfilingConfig, rank: Optional[int] = None) -> Optional[str]:
    """Write the CUDA memory snapshot to ``{memory_snapshot_path stem}_{rank}{ext}``; returns the path.

    Returns None (and writes nothing) without CUDA or when the rank is not profiled.
    """
    rank = get_rank() if rank is None else rank
    if not torch.cuda.is_available() or rank not in list(profiling.profile_ranks or [0]):
        return None
    base, ext = os.path.splitext(profiling.memory_snapshot_path)
    filename = f"{base}_{rank}{ext}"
    with open(filename, "wb") as f:
        pickle.dump(torch.cuda.memory._snapshot(), f)
    logger.info(f"Saved memory snapshot to {filename}")
    return filename
