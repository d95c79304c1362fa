"""The attention kernels a ``SelfAttention`` layer calls on ``[b, heads, s, d]`` queries and ``[b, groups, s, d]``
keys/values: the fused SDPA path (``core_attention``) and the unfused variants that materialize the scores
(``attention_softmax_in_fp32=False``, Gemma 2's soft-capping; attention sinks live in ``attention_sinks``), with
the two pieces they share: grouped-query head repetition and the dense form of a mask.

Masks follow Megatron: bool, True = masked; ``None`` means causal; a ``WindowedMask`` is a sliding-window layer's
band together with the caller's mask.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from longspan.models.sliding_window import WindowedMask, windowed_attention


def repeat_kv(t: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Keys or values ``[b, groups, s, d]`` repeated to ``[b, groups * n_rep, s, d]``: query head i attends with
    kv group i // n_rep, as in Megatron Core and HF's repeat_kv."""
    if n_rep == 1:
        return t
    b, g, s, d = t.shape
    return t[:, :, None].expand(b, g, n_rep, s, d).reshape(b, g * n_rep, s, d)


def dense_mask(attention_mask: torch.Tensor | WindowedMask | None, s_q: int, s_k: int,
               device: torch.device) -> torch.Tensor:
    """``attention_mask`` as a bool tensor (True = masked) broadcastable to ``[b, heads, s_q, s_k]``. ``None`` is
    causal with the queries at the end of the keys (queries after cached keys); a 0/1 or additive 0/-inf mask
    counts non-zero as masked."""
    if isinstance(attention_mask, WindowedMask):
        return ~attention_mask.dense_keep(s_q, s_k, device)
    if attention_mask is None:
        return torch.ones(s_q, s_k, dtype=torch.bool, device=device).triu(s_k - s_q + 1)
    return attention_mask if attention_mask.dtype == torch.bool else attention_mask != 0


def core_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attention_mask: torch.Tensor | WindowedMask | None,
    dropout_p: float,
    scale: float | None,
) -> torch.Tensor:
    """Scaled dot-product attention; grouped k/v heads are repeated. ``None`` takes SDPA's causal fast path; a
    ``WindowedMask`` runs ``longspan.models.sliding_window.windowed_attention``."""
    n_rep = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    if isinstance(attention_mask, WindowedMask):
        return windowed_attention(q, k, v, attention_mask, dropout_p, scale)
    if attention_mask is None:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale)
    keep = ~dense_mask(attention_mask, q.shape[2], k.shape[2], q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=dropout_p, scale=scale)


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float | None) -> torch.Tensor:
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return torch.matmul(q, k.transpose(-2, -1)) * scale


def low_precision_softmax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attention_mask: torch.Tensor | WindowedMask | None,
    dropout_p: float,
    scale: float | None,
) -> torch.Tensor:
    """``core_attention`` with the scores and softmax probabilities materialized in the inputs' dtype
    (``attention_softmax_in_fp32=False``, Megatron's unfused path without the fp32 upcast): for bf16/fp16
    inputs the scores are rounded before the softmax and the probabilities before they weight the values.
    float32 inputs take ``core_attention`` (the same maths)."""
    if q.dtype == torch.float32:
        return core_attention(q, k, v, attention_mask, dropout_p, scale)
    n_rep = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    scores = _scores(q, k, scale)
    scores = scores.masked_fill(dense_mask(attention_mask, q.shape[2], k.shape[2], q.device),
                                torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1)  # stays in the inputs' dtype
    probs = F.dropout(probs, p=dropout_p) if dropout_p > 0 else probs
    return torch.matmul(probs, v)


def softcapped_core_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attention_mask: torch.Tensor | WindowedMask | None,
    dropout_p: float,
    scale: float | None,
    *,
    softcap: float,
) -> torch.Tensor:
    """``core_attention`` with Gemma 2's soft-capped scores: ``cap * tanh(q·k * scale / cap)`` before the mask
    and a float32 softmax, in HF's order. Unfused (SDPA has no soft-cap): the scores are materialized."""
    n_rep = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    scores = torch.tanh(_scores(q, k, scale) / softcap) * softcap
    scores = scores.masked_fill(dense_mask(attention_mask, q.shape[2], k.shape[2], q.device),
                                torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p)
    return torch.matmul(probs, v)
