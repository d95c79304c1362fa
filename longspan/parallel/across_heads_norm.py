"""QK-norm across heads (``qk_layernorm_across_heads``: one RMSNorm over a token's whole query or key projection,
OLMo-2, OLMoE, MiniMax-M2) under tensor parallel.

Tensor parallel splits ``linear_q`` / ``linear_k`` column-wise by whole heads, so each rank holds a slice of the
channels the norm spans. The norm's weight is split the same way (a ``Shard(0)`` DTensor: each rank keeps the
weights of its heads' channels), and its statistic needs every rank's share: each rank sums the squares of its
channels, the sums are all-reduced over the tp group (backward: the gradient of the sum all-reduced, as it
reaches every rank's channels) and divided by the whole width, so each rank normalizes its slice exactly as one
process normalizes the whole projection (megatron-bridge's full-dimension Q/K norm does the same).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.nn.functional import all_reduce
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from longspan.core.errors import NotSupportedError
from longspan.models.transformer import RMSNorm


class HeadShardedRMSNorm(RMSNorm):
    """An RMSNorm over ``normalized_shape`` channels of which this rank holds a contiguous ``1/tp`` slice (its
    heads'): the weight is a ``Shard(0)`` DTensor, the mean square is taken over every rank's channels."""

    def __init__(self, norm: RMSNorm, tp_mesh: Any) -> None:
        (width,) = norm.normalized_shape
        super().__init__(width, eps=norm.eps, dtype=norm.weight.dtype, zero_centered_gamma=norm.zero_centered_gamma)
        self.tp_mesh = tp_mesh
        weight = norm.weight
        if not isinstance(weight, DTensor):
            weight = distribute_tensor(weight.data, tp_mesh, [Shard(0)])
        self.weight = nn.Parameter(weight, requires_grad=norm.weight.requires_grad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        width = self.normalized_shape[0]
        xf = x.float()
        squares = all_reduce(xf.pow(2).sum(-1, keepdim=True), group=self.tp_mesh.get_group())
        normed = xf * torch.rsqrt(squares / width + self.eps)
        weight = self.weight.to_local()
        if self.zero_centered_gamma:
            return ((1.0 + weight.float()) * normed).to(x.dtype)
        return weight * normed.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape[0]} over {self.tp_mesh.size()} ranks, eps={self.eps}"


def shard_across_heads_qk_norms(attentions: list[nn.Module], tp_mesh: Any) -> None:
    """Make the q / k norms of each attention module with ``qk_norm_across_heads`` head-sharded over
    ``tp_mesh`` (in place; the parameters keep their names ``q_layernorm.weight`` / ``k_layernorm.weight``)."""
    for attention in attentions:
        if not getattr(attention, "qk_norm_across_heads", False) or attention.q_layernorm is None:
            continue
        for name in ("q_layernorm", "k_layernorm"):
            norm = getattr(attention, name)
            if not isinstance(norm, RMSNorm):
                raise NotSupportedError(
                    f"model.qk_layernorm_across_heads=True with normalization={type(norm).__name__} under tensor "
                    "parallel is not supported: use normalization='RMSNorm' or tensor_model_parallel_size=1"
                )
            if not isinstance(norm, HeadShardedRMSNorm):
                setattr(attention, name, HeadShardedRMSNorm(norm, tp_mesh))
