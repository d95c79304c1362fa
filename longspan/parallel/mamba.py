"""Tensor parallel plan for Mamba-2 mixers (``longspan.models.mamba.MambaMixer``): heads split across ranks.

As in Megatron's MambaMixer, tensor-parallel rank ``r`` of ``T`` computes heads ``[r·H/T, (r+1)·H/T)`` and
their groups: it uses its slice of each segment of ``in_proj`` (rows of z, x, B, C and dt each cut in ``T``),
the matching conv1d channels (x, B, C), ``A_log`` / ``D`` / ``dt_bias`` entries, gated-norm channels and
``out_proj`` columns, so the scan, conv and norm run on local heads only. The mixer's input is the replicated
residual stream (its gradient is summed over the ranks on the way back) and the ``out_proj`` partial sums
are all-reduced.

The fused ``in_proj`` interleaves five segments, so a contiguous DTensor row split cannot express this cut.
The mixer's parameters therefore stay whole (replicated) plain tensors on every rank, checkpoints and init
are the one-process ones, and each rank slices its heads in the forward: the slicing's backward scatters the
local gradient into a full-size tensor and sums it over the ranks, so every rank ends with the full,
identical gradient (as for the replicated norms of the tensor-parallel GPT). Compute and activations are
split by heads, parameter and optimizer memory is not. Sequence parallel is not supported with Mamba layers.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from longspan.core.errors import ConfigError, NotSupportedError
from longspan.parallel.collectives import copy_to_group, reduce_from_group


class _SliceReplicated(torch.autograd.Function):
    """``full.index_select(dim, index)``; backward: the local gradient scattered into ``full``'s shape and
    summed over ``group`` (each rank contributes its own rows)."""

    @staticmethod
    def forward(ctx: Any, full: torch.Tensor, dim: int, index: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.dim, ctx.group, ctx.shape = dim, group, full.shape
        ctx.save_for_backward(index)
        return full.index_select(dim, index)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        (index,) = ctx.saved_tensors
        full = grad.new_zeros(ctx.shape).index_copy_(ctx.dim, index, grad.contiguous())
        dist.all_reduce(full, group=ctx.group)
        return full, None, None, None


def _segments(ranges: list[tuple[int, int]], rank: int, size: int) -> torch.Tensor:
    """Indices of rank ``rank``'s ``1/size`` of each ``(start, length)`` segment, concatenated."""
    parts = []
    for start, length in ranges:
        piece = length // size
        parts.append(torch.arange(start + rank * piece, start + (rank + 1) * piece))
    return torch.cat(parts)


def is_mamba_mixer(module: nn.Module) -> bool:
    """A Mamba-2 mixer (it has the fused ``in_proj`` and the per-head ``A_log``)."""
    return hasattr(module, "local_parameters") and hasattr(module, "A_log")


def check_mamba_tensor_parallel(mixer: nn.Module, tp: int) -> None:
    """Raise (one line) when ``tp`` does not divide the mixer's heads and groups."""
    if mixer.heads % tp or mixer.groups % tp:
        raise ConfigError(
            f"model.tensor_model_parallel_size={tp} must divide the Mamba heads ({mixer.heads}) and "
            f"model.mamba_num_groups={mixer.groups}"
        )


def apply_mamba_tensor_parallel(model: nn.Module, tp_mesh: Any, sequence_parallel: bool = False) -> int:
    """Split every Mamba mixer of ``model`` by heads over ``tp_mesh`` (in place); returns how many."""
    mixers = [m for m in model.modules() if is_mamba_mixer(m)]
    if not mixers:
        return 0
    tp = tp_mesh.size()
    if sequence_parallel:
        raise NotSupportedError(
            f"model.sequence_parallel=True with Mamba layers (tensor_model_parallel_size={tp}) is not supported "
            "yet: set sequence_parallel=False"
        )
    for mixer in mixers:
        check_mamba_tensor_parallel(mixer, tp)
    group, rank = tp_mesh.get_group(), tp_mesh.get_local_rank()
    for mixer in mixers:
        _shard_mixer(mixer, group, rank, tp)
    return len(mixers)


def _shard_mixer(mixer: nn.Module, group: Any, rank: int, tp: int) -> None:
    d, g, h = mixer.d_inner, mixer.groups * mixer.state_dim, mixer.heads
    in_rows = _segments([(0, d), (d, d), (2 * d, g), (2 * d + g, g), (2 * d + 2 * g, h)], rank, tp)
    conv_channels = _segments([(0, d), (d, g), (d + g, g)], rank, tp)
    heads = _segments([(0, h)], rank, tp)
    channels = _segments([(0, d)], rank, tp)

    def local_parameters() -> SimpleNamespace:
        full = SimpleNamespace(**vars(type(mixer).local_parameters(mixer)))

        def take(t: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
            return _SliceReplicated.apply(t, dim, index.to(t.device), group)

        return SimpleNamespace(
            in_proj=take(full.in_proj, 0, in_rows),
            conv_weight=take(full.conv_weight, 0, conv_channels),
            conv_bias=take(full.conv_bias, 0, conv_channels),
            A_log=take(full.A_log, 0, heads),
            D=take(full.D, 0, heads),
            dt_bias=take(full.dt_bias, 0, heads),
            norm=take(full.norm, 0, channels),
            out_proj=take(full.out_proj, 1, channels),
            d_inner=full.d_inner // tp,
            heads=full.heads // tp,
            groups=full.groups // tp,
        )

    mixer.local_parameters = local_parameters
    mixer.register_forward_pre_hook(lambda _m, args: (copy_to_group(args[0], group), *args[1:]))
    mixer.register_forward_hook(lambda _m, _args, out: reduce_from_group(out, group))
