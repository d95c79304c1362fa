"""Attention with sinks: one extra logit per head in the softmax's denominator (GPT-OSS's learned ``sinks``,
Megatron's ``softmax_type`` 'learnable'; a fixed zero logit is 'off-by-one'). Plain PyTorch, used by
``longspan.models.transformer.SelfAttention`` when the provider's ``softmax_type`` is not 'vanilla'; models
without sinks keep the fused SDPA path."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from longspan.models.sliding_window import WindowedMask


def sink_core_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout_p: float,
    scale: float | None,
    *,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """``core_attention`` with one extra logit per head in the softmax (attention sinks, GPT-OSS; Megatron's
    ``softmax_type`` 'learnable' / 'off-by-one'): ``softmax([scores, sink_h])`` without the sink's column, in
    HF's order (mask, the row maximum subtracted, float32 softmax). Unfused: the scores are materialized.
    ``sinks`` holds this process's heads ``[heads]``."""
    n_rep = q.shape[1] // k.shape[1]
    if n_rep > 1:
        k = k.repeat_interleave(n_rep, dim=1)
        v = v.repeat_interleave(n_rep, dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (torch.matmul(q, k.transpose(-2, -1)) * scale).float()
    b, h, s_q, s_k = scores.shape
    if isinstance(attention_mask, WindowedMask):  # a sliding-window layer: its band and the caller's mask
        attention_mask = ~attention_mask.dense_keep(s_q, s_k, scores.device)
    elif attention_mask is None:  # causal, bottom-right aligned (queries after cached keys)
        attention_mask = torch.ones(s_q, s_k, dtype=torch.bool, device=scores.device).triu(s_k - s_q + 1)
    elif attention_mask.dtype != torch.bool:
        attention_mask = attention_mask != 0
    scores = scores.masked_fill(attention_mask, torch.finfo(scores.dtype).min)
    sink = sinks.float().view(1, h, 1, 1).expand(b, h, s_q, 1)
    logits = torch.cat([scores, sink], dim=-1)
    logits = logits - logits.amax(dim=-1, keepdim=True)
    probs = torch.softmax(logits, dim=-1)[..., :-1].to(q.dtype)
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p)
    return torch.matmul(probs, v)
