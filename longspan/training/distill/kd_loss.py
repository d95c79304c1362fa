"""The logits KL-divergence of distillation over chunks of tokens, without the ``[tokens, vocab]`` logits.

``linear_kl_divergence(hidden_s, weight_s, hidden_t, weight_t, temperature)`` is ModelOpt's ``LogitsKLLoss``
per token (what Megatron Bridge's distillation minimises): ``KL(p_t || p_s) = Σ_v p_t (log p_t - log p_s)`` with
``p = softmax(logits / temperature)``, student logits ``hidden_s @ weight_s.T`` and teacher logits
``hidden_t @ weight_t.T``, no ``temperature²`` factor. As ``longspan.models.loss.linear_cross_entropy`` does for
the LM loss, only one chunk of each model's logits exists at a time: the forward keeps three floats per token
(both log-sum-exps and ``Σ_v p_t (z_t - z_s)``) and the backward recomputes each chunk's logits to form
``d KL / d student logits = (p_s - p_t) / temperature``. The teacher gets no gradient.

Vocabulary shards (tensor parallel): each rank holds the same rows of both output layers (the vocabularies are
equal, checked at start-up); the per-token values of the shards are combined with one max and one sum
all-reduce, and the student's hidden-state gradient is summed over the shards, as the vocab-parallel LM loss does.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate

from longspan.models.loss import default_chunk_tokens

ReduceFn = Callable[[torch.Tensor], torch.Tensor]


class _ChunkedLinearKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_s, weight_s, hidden_t, weight_t,  # type: ignore[override]
                temperature, chunk, reduce_max, reduce_sum):
        n = hidden_s.shape[0]
        lse_s = torch.empty(n, dtype=torch.float32, device=hidden_s.device)
        lse_t = torch.empty_like(lse_s)
        cross = torch.empty_like(lse_s)  # Σ_v softmax_shard(z_t) (z_t - z_s) over this shard's vocabulary
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            z_s = F.linear(hidden_s[start:end], weight_s).float() / temperature
            z_t = F.linear(hidden_t[start:end], weight_t).float() / temperature
            lse_s[start:end] = torch.logsumexp(z_s, dim=-1)
            lse_t[start:end] = torch.logsumexp(z_t, dim=-1)
            p_t = torch.exp(z_t - lse_t[start:end].unsqueeze(1))
            cross[start:end] = (p_t * (z_t - z_s)).sum(-1)
        if reduce_max is not None:  # combine the shards: log Σ exp over shards, p_t-weighted mean of `cross`
            top_s = reduce_max(lse_s.clone())
            top_t = reduce_max(lse_t.clone())
            share_t = torch.exp(lse_t - top_t)
            sums = torch.stack([torch.exp(lse_s - top_s), share_t, share_t * cross])
            reduce_sum(sums)
            lse_s = top_s + torch.log(sums[0])
            lse_t = top_t + torch.log(sums[1])
            cross = sums[2] / sums[1]
        ctx.save_for_backward(hidden_s, weight_s, hidden_t, weight_t, lse_s, lse_t)
        ctx.temperature, ctx.chunk, ctx.reduce_sum = temperature, chunk, reduce_sum
        return cross - lse_t + lse_s

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        hidden_s, weight_s, hidden_t, weight_t, lse_s, lse_t = ctx.saved_tensors
        temperature = ctx.temperature
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden_s) if need_hidden else None
        grad_weight = torch.zeros(weight_s.shape, dtype=torch.float32, device=weight_s.device) if need_weight else None
        scale = grad.float() / temperature
        n = hidden_s.shape[0]
        for start in range(0, n, ctx.chunk):
            end = min(start + ctx.chunk, n)
            chunk_s = hidden_s[start:end]
            p_s = torch.exp(F.linear(chunk_s, weight_s).float() / temperature - lse_s[start:end].unsqueeze(1))
            p_t = torch.exp(F.linear(hidden_t[start:end], weight_t).float() / temperature
                            - lse_t[start:end].unsqueeze(1))
            grad_logits = ((p_s - p_t) * scale[start:end].unsqueeze(1)).to(weight_s.dtype)
            if need_hidden:
                grad_hidden[start:end] = grad_logits @ weight_s
            if need_weight:
                grad_weight += (grad_logits.t() @ chunk_s).float()
        if need_hidden and ctx.reduce_sum is not None:
            ctx.reduce_sum(grad_hidden)  # each vocabulary shard gives a partial d KL / d hidden
        if need_weight:
            grad_weight = grad_weight.to(weight_s.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None


def linear_kl_divergence(
    hidden_s: torch.Tensor,
    weight_s: torch.Tensor,
    hidden_t: torch.Tensor,
    weight_t: torch.Tensor,
    temperature: float = 1.0,
    *,
    chunk_tokens: Optional[int] = None,
    reduce_max: Optional[ReduceFn] = None,
    reduce_sum: Optional[ReduceFn] = None,
) -> torch.Tensor:
    """Per-token float32 ``KL(teacher || student)`` of the two output projections at ``temperature``.

    Args:
        hidden_s, hidden_t: ``[..., h_s]`` / ``[..., h_t]`` final hidden states with the same leading shape.
        weight_s, weight_t: ``[vocab, h]`` output projections (the same vocabulary shard of each with the
            reductions); gradients flow to ``hidden_s`` and ``weight_s`` only.
        chunk_tokens: tokens per chunk; default ``default_chunk_tokens`` of the vocabulary (two models' logits
            per chunk, so half the LM loss's budget each).
        reduce_max, reduce_sum: in-place all-reduces over the vocabulary shards; None on one shard.
    """
    if (reduce_max is None) != (reduce_sum is None):
        raise ValueError("linear_kl_divergence: pass both reduce_max and reduce_sum, or neither")
    lead = hidden_s.shape[:-1]
    flat_s = hidden_s.reshape(-1, hidden_s.shape[-1])
    flat_t = hidden_t.reshape(-1, hidden_t.shape[-1]).detach()
    weight_t = weight_t.detach()
    device_type = flat_s.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        flat_s, weight_s, flat_t, weight_t = flat_s.to(dtype), weight_s.to(dtype), flat_t.to(dtype), weight_t.to(dtype)
    else:
        flat_t, weight_t = flat_t.to(flat_s.dtype), weight_t.to(weight_s.dtype)
    chunk = int(chunk_tokens) if chunk_tokens else max(1, default_chunk_tokens(weight_s.shape[0]) // 2)
    with torch.autocast(device_type, enabled=False):
        kl = _ChunkedLinearKL.apply(flat_s, weight_s, flat_t, weight_t, float(temperature), chunk, reduce_max,
                                    reduce_sum)
    return kl.view(lead)


def replicated_hidden(hidden: torch.Tensor) -> torch.Tensor:
    """Hidden states as a plain tensor of every token: a DTensor (sequence parallel) is gathered first."""
    if isinstance(hidden, DTensor):
        return hidden.redistribute(placements=[Replicate()] * hidden.device_mesh.ndim).to_local()
    return hidden


def vocab_shard(weight: torch.Tensor) -> tuple[torch.Tensor, int, Any]:
    """``(local rows, first vocabulary id, process group)`` of an output weight: a 1-D vocab-sharded DTensor
    (tensor parallel) gives its local shard (differentiably) and its group; a plain tensor gives itself and None.
    Any other DTensor is gathered whole (correct, not vocab-parallel)."""
    if not isinstance(weight, DTensor):
        return weight, 0, None
    mesh = weight.device_mesh
    if mesh.ndim != 1 or not weight.placements[0].is_shard(0):
        return weight.redistribute(placements=[Replicate()] * mesh.ndim).to_local(), 0, None
    local = weight.to_local()
    return local, mesh.get_local_rank() * local.shape[0], mesh.get_group()


def group_reductions(group: Any) -> tuple[Optional[ReduceFn], Optional[ReduceFn]]:
    """In-place (max, sum) all-reduces over ``group``; (None, None) for no group or a group of one."""
    if group is None or dist.get_world_size(group) == 1:
        return None, None

    def reduce_max(t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return t

    def reduce_sum(t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
        return t

    return reduce_max, reduce_sum
