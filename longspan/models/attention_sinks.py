"""Attention with sinks: one extra logit per head in the softmax's denominator (GPT-OSS's learned ``sinks``,
Megatron's ``softmax_type`` 'learnable'; a fixed zero logit is 'off-by-one'). Plain PyTorch, used by
``longspan.models.transformer.SelfAttention`` when the provider's ``softmax_type`` is not 'vanilla'; models
without sinks keep the fused SDPA path."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from longspan.models.attention import dense_mask, repeat_kv


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
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (torch.matmul(q, k.transpose(-2, -1)) * scale).float()
    b, h, s_q, s_k = scores.shape
    scores = scores.masked_fill(dense_mask(attention_mask, s_q, s_k, scores.device), torch.finfo(scores.dtype).min)
    sink = sinks.float().view(1, h, 1, 1).expand(b, h, s_q, 1)
    logits = torch.cat([scores, sink], dim=-1)
    logits = logits - logits.amax(dim=-1, keepdim=True)
    probs = torch.softmax(logits, dim=-1)[..., :-1].to(q.dtype)
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p)
    return torch.matmul(probs, v)
