"""Collectives over a process group: small host-side ones that are no-ops on one process, and the
autograd-aware copy/reduce pair the parallel plans put around a split computation.

Every host-side helper takes ``group`` (a ProcessGroup; ``None`` means the default/world group) and returns
the local value unchanged when torch.distributed is not initialized or the group has one rank, so
single-process code never touches torch.distributed. Scalars travel as float64 tensors on the device the
group's backend needs (CUDA for a pure NCCL group, CPU otherwise).

``copy_to_group`` / ``reduce_from_group`` are Megatron's ``copy_to_tensor_model_parallel_region`` /
``reduce_from_tensor_model_parallel_region`` for any group: the input of a computation split over the ranks
is copied in (its gradient summed on the way back), the partial outputs are summed (the gradient passes
through). Expert tensor parallel and the Mamba mixers' head split use them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def _active(group: Any) -> bool:
    if not (dist.is_available() and dist.is_initialized()):
        return False
    return dist.get_world_size(group) > 1


def _device_for(group: Any) -> Any:
    backend = str(dist.get_backend(group))
    if "nccl" in backend and "gloo" not in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_reduce_scalar(value: float, op: Any, group: Any) -> float:
    t = torch.tensor([float(value)], dtype=torch.float64, device=_device_for(group))
    dist.all_reduce(t, op=op, group=group)
    return float(t.item())


def all_reduce_max(value: float, group: Any = None) -> float:
    """The maximum of ``value`` over ``group``."""
    if not _active(group):
        return float(value)
    return _all_reduce_scalar(value, dist.ReduceOp.MAX, group)


def all_reduce_sum(value: float, group: Any = None) -> float:
    """The sum of ``value`` over ``group``."""
    if not _active(group):
        return float(value)
    return _all_reduce_scalar(value, dist.ReduceOp.SUM, group)


def logical_and(flag: bool, group: Any = None) -> bool:
    """True only if ``flag`` is true on every rank of ``group``."""
    if not _active(group):
        return bool(flag)
    return _all_reduce_scalar(1.0 if flag else 0.0, dist.ReduceOp.MIN, group) > 0.5


def logical_or(flag: bool, group: Any = None) -> bool:
    """True if ``flag`` is true on any rank of ``group`` (e.g. "a signal arrived somewhere")."""
    if not _active(group):
        return bool(flag)
    return _all_reduce_scalar(1.0 if flag else 0.0, dist.ReduceOp.MAX, group) > 0.5


def broadcast_object(obj: Any, src: int = 0, group: Any = None) -> Any:
    """``obj`` from global rank ``src`` (picklable), returned on every rank of ``group``."""
    if not _active(group):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group, device=_device_for(group))
    return box[0]


def all_gather_object(obj: Any, group: Any = None) -> list:
    """Every rank's ``obj``, ordered by rank within ``group`` (``[obj]`` on one process)."""
    if not _active(group):
        return [obj]
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def barrier(group: Any = None) -> None:
    """Wait until every rank of ``group`` gets here."""
    if not _active(group):
        return
    dist.barrier(group=group)


# ------------------------------------------------------------------------------------ autograd copy / reduce


class _CopyToGroup(torch.autograd.Function):
    """Identity forward; backward sums the gradient over ``group``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()  # the incoming gradient may be shared: reduce a copy
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromGroup(torch.autograd.Function):
    """Sum over ``group`` forward; identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def copy_to_group(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``x`` unchanged; its gradient is summed over ``group`` (the input of a computation split over it)."""
    return _CopyToGroup.apply(x, group)


def reduce_from_group(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``x`` summed over ``group`` (the partial outputs of a split computation); the gradient passes through."""
    return _ReduceFromGroup.apply(x, group)
