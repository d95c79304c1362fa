"""Small collectives over a process group that are no-ops on one process.

Every helper takes ``group`` (a ProcessGroup; ``None`` means the default/world group) and returns the local
value unchanged when torch.distributed is not initialized or the group has one rank, so single-process code
never touches torch.distributed. Scalars travel as float64 tensors on the device the group's backend needs
(CUDA for a pure NCCL group, CPU otherwise).
"""

from __future__ import annotations

from typing import Any


def _active(group: Any) -> bool:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return False
    return dist.get_world_size(group) > 1


def _device_for(group: Any) -> Any:
    import torch
    import torch.distributed as dist

    backend = str(dist.get_backend(group))
    if "nccl" in backend and "gloo" not in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_reduce_scalar(value: float, op: Any, group: Any) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(value)], dtype=torch.float64, device=_device_for(group))
    dist.all_reduce(t, op=op, group=group)
    return float(t.item())


def all_reduce_max(value: float, group: Any = None) -> float:
    """The maximum of ``value`` over ``group``."""
    if not _active(group):
        return float(value)
    import torch.distributed as dist

    return _all_reduce_scalar(value, dist.ReduceOp.MAX, group)


def all_reduce_sum(value: float, group: Any = None) -> float:
    """The sum of ``value`` over ``group``."""
    if not _active(group):
        return float(value)
    import torch.distributed as dist

    return _all_reduce_scalar(value, dist.ReduceOp.SUM, group)


def logical_and(flag: bool, group: Any = None) -> bool:
    """True only if ``flag`` is true on every rank of ``group``."""
    if not _active(group):
        return bool(flag)
    import torch.distributed as dist

    return _all_reduce_scalar(1.0 if flag else 0.0, dist.ReduceOp.MIN, group) > 0.5


def logical_or(flag: bool, group: Any = None) -> bool:
    """True if ``flag`` is true on any rank of ``group`` (e.g. "a signal arrived somewhere")."""
    if not _active(group):
        return bool(flag)
    import torch.distributed as dist

    return _all_reduce_scalar(1.0 if flag else 0.0, dist.ReduceOp.MAX, group) > 0.5


def broadcast_object(obj: Any, src: int = 0, group: Any = None) -> Any:
    """``obj`` from global rank ``src`` (picklable), returned on every rank of ``group``."""
    if not _active(group):
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group, device=_device_for(group))
    return box[0]


def all_gather_object(obj: Any, group: Any = None) -> list:
    """Every rank's ``obj``, ordered by rank within ``group`` (``[obj]`` on one process)."""
    if not _active(group):
        return [obj]
    import torch.distributed as dist

    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def barrier(group: Any = None) -> None:
    """Wait until every rank of ``group`` gets here."""
    if not _active(group):
        return
    import torch.distributed as dist

    dist.barrier(group=group)
