"""The chunked linear + cross-entropy (``longspan.models.loss``) on a vocab-sharded output layer.

Under tensor parallel the output layer's weight is a ``DTensor`` sharded over the vocabulary
(``Shard(0)`` on the tp mesh). Each rank computes its shard's logits chunk by chunk; the per-token
log-sum-exp and the target logit are combined with two all-reduces over the tp group (max, then one sum of
both), and in backward the partial gradients of the hidden states are summed over the group. Neither the
full logits nor a gathered weight ever exist. ``apply_tensor_parallel`` installs this as the model's
``linear_cross_entropy``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from longspan.models.loss import linear_cross_entropy


def vocab_parallel_linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, chunk_tokens: Optional[int] = None
) -> torch.Tensor:
    """``linear_cross_entropy`` where ``weight`` may be a vocab-sharded DTensor and ``hidden`` a DTensor.

    Sequence-sharded hidden states (sequence parallel) are gathered first, as the output layer's plan does.
    A weight with another placement is gathered (correct, not vocab-parallel).
    """
    if isinstance(hidden, DTensor):
        hidden = hidden.redistribute(placements=[Replicate()] * hidden.device_mesh.ndim).to_local()
    if not isinstance(weight, DTensor):
        return linear_cross_entropy(hidden, weight, labels, chunk_tokens=chunk_tokens)
    placements = weight.placements
    if weight.device_mesh.ndim != 1 or not placements[0].is_shard(0):
        full = weight.redistribute(placements=[Replicate()] * weight.device_mesh.ndim).to_local()
        return linear_cross_entropy(hidden, full, labels, chunk_tokens=chunk_tokens)
    mesh = weight.device_mesh
    group = mesh.get_group()
    local = weight.to_local()
    vocab_start = mesh.get_local_rank() * local.shape[0]  # the tp plan checks the vocabulary divides evenly

    def reduce_max(t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return t

    def reduce_sum(t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
        return t

    return linear_cross_entropy(
        hidden, local, labels, chunk_tokens=chunk_tokens, vocab_start=vocab_start,
        reduce_max=reduce_max, reduce_sum=reduce_sum,
    )


def install(model: Any) -> None:
    """Make ``model`` (a GPTModel) use the vocab-parallel chunked loss when its fused loss is on."""
    model.linear_cross_entropy = vocab_parallel_linear_cross_entropy
