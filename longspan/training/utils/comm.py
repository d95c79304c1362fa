"""Small helpers for the few collectives the logging code needs.

Logging reductions (timers, norms, max-stats) are tiny tensors; they must live on the device the process
group's backend can reduce: CUDA for NCCL, CPU for Gloo. Every helper here degrades to a no-op when
torch.distributed is not initialized, so single-process runs never touch a collective.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist


def dist_ready() -> bool:
    """True when torch.distributed is available and a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def group_size(group: Optional[Any]) -> int:
    """Number of ranks in ``group`` (the default group when None); 1 when not distributed.

    Accepts anything with a ``size()`` method as well as real ProcessGroups, so single-process stand-ins
    (tests, ``pg_collection`` placeholders) work too.
    """
    if not dist_ready():
        return 1
    if group is None:
        return dist.get_world_size()
    size = getattr(group, "size", None)
    if callable(size):
        return int(size())
    return dist.get_world_size(group=group)


def collective_device(group: Optional[Any] = None) -> torch.device:
    """The device a small tensor must be on to be reduced over ``group``.

    NCCL only reduces CUDA tensors; Gloo only CPU ones. A mixed backend string such as ``cpu:gloo,cuda:nccl``
    accepts both, and CPU avoids a host-device copy for these tiny tensors.
    """
    if not dist_ready():
        return torch.device("cpu")
    backend = str(dist.get_backend(group))
    if "gloo" in backend or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def cuda_synchronize_if_used() -> None:
    """Wait for queued CUDA work, but only when this process has actually initialized CUDA.

    ``torch.cuda.is_initialized()`` is false on CPU-only runs (and on GPU machines that never used the GPU),
    so CPU timers pay nothing and never create a CUDA context by accident.
    """
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def reduce_max_stat_across_model_parallel_group(stat: Optional[float], mp_group: Any) -> Optional[float]:
    """Max of ``stat`` over the model-parallel group; ranks may pass None (e.g. no optimizer there).

    Args:
        stat: the value on this rank, or None.
        mp_group: the process group to reduce across (``pg_collection.mp``); None or a one-rank group
            means no reduction.

    Returns:
        The maximum over the ranks that had a value, or None if every rank had None.
    """
    if mp_group is None or not dist_ready() or group_size(mp_group) <= 1:
        return stat
    value = torch.tensor(
        [float("-inf") if stat is None else float(stat)], dtype=torch.float64, device=collective_device(mp_group)
    )
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=mp_group)
    result = value.item()
    return None if result == float("-inf") else result


def logical_and_across_model_parallel_group(input: bool, mp_group: Any) -> bool:
    """Logical AND of ``input`` over the model-parallel group (``input`` itself when not distributed)."""
    if mp_group is None or not dist_ready() or group_size(mp_group) <= 1:
        return bool(input)
    value = torch.tensor([1 if input else 0], dtype=torch.int32, device=collective_device(mp_group))
    dist.all_reduce(value, op=dist.ReduceOp.MIN, group=mp_group)
    return bool(value.item())
