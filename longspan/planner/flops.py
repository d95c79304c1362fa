"""Model FLOPs per training iteration (forward + backward), Megatron's formula.

For batch B, sequence s, hidden h, layers L, vocabulary V, query width q = kv_channels * heads, key/value width
k = kv_channels * query_groups, FFN width f, and F = 3 for gated (SwiGLU) MLPs else 2:

    B*s*[ 6*h*F*f*L + 6*L*(h*(q + 2k) + q*h) + 6*h*V ] + 6*q*L*B*s^2

(each matmul costs 2 FLOPs per multiply-add, training costs 3x the forward pass, and causal attention halves
the s^2 term). An MoE layer replaces f by ``moe_ffn_hidden_size * moe_router_topk`` plus the shared experts'
``moe_shared_expert_intermediate_size``. Multi-latent attention counts its own projections and core
(``_mla_attention_terms``).
"""

from __future__ import annotations

from typing import Any

from longspan.core.vocab import calculate_padded_vocab_size


def _moe_layer_flags(model: Any, num_layers: int) -> list[bool]:
    """Which layers are MoE layers: ``moe_layer_freq`` is an int (every n-th layer) or a 0/1 list."""
    if not getattr(model, "num_moe_experts", None):
        return [False] * num_layers
    freq = getattr(model, "moe_layer_freq", 1)
    if isinstance(freq, int):
        return [i % max(freq, 1) == 0 for i in range(num_layers)]
    flags = [bool(x) for x in freq]
    if len(flags) != num_layers:
        raise ValueError(f"moe_layer_freq has {len(flags)} entries for {num_layers} layers")
    return flags


def _vocab_size(model: Any) -> int:
    padded = getattr(model, "padded_vocab_size", None)
    if padded:
        return int(padded)
    return calculate_padded_vocab_size(int(model.vocab_size), int(getattr(model, "make_vocab_size_divisible_by", 128)))


def _seq_length(cfg: Any) -> int:
    seq = getattr(cfg.model, "seq_length", None)
    if not seq:
        seq = getattr(getattr(cfg, "dataset", None), "seq_length", None)
    if not seq:
        raise ValueError("num_floating_point_operations needs model.seq_length or dataset.seq_length")
    return int(seq)


def num_floating_point_operations(cfg: Any, batch_size: int = 1) -> float:
    """Training FLOPs (forward + backward) of one iteration over ``batch_size`` sequences.

    Reads ``cfg.model``: num_layers, hidden_size, num_attention_heads, num_query_groups (default: heads),
    kv_channels (default: hidden/heads), ffn_hidden_size (default: 4*hidden), gated_linear_unit,
    padded_vocab_size (or vocab_size padded to make_vocab_size_divisible_by), seq_length (else
    ``cfg.dataset.seq_length``), and for MoE num_moe_experts, moe_router_topk, moe_ffn_hidden_size,
    moe_shared_expert_intermediate_size, moe_layer_freq.
    """
    model = cfg.model
    h = int(model.hidden_size)
    num_layers = int(model.num_layers)
    heads = int(model.num_attention_heads)
    groups = int(getattr(model, "num_query_groups", None) or heads)
    kv_channels = int(getattr(model, "kv_channels", None) or h // heads)
    dense_ffn = int(getattr(model, "ffn_hidden_size", None) or 4 * h)
    gated = 3 if getattr(model, "gated_linear_unit", False) else 2
    vocab = _vocab_size(model)
    s = _seq_length(cfg)
    B = int(batch_size)

    q = kv_channels * heads
    k = kv_channels * groups

    moe_flags = _moe_layer_flags(model, num_layers)
    topk = int(getattr(model, "moe_router_topk", 2) or 2)
    moe_ffn = int(getattr(model, "moe_ffn_hidden_size", None) or dense_ffn)
    shared_ffn = int(getattr(model, "moe_shared_expert_intermediate_size", None) or 0)
    # Sum of the per-layer MLP widths: dense layers use f, MoE layers the routed experts plus shared ones.
    ffn_width_sum = sum((moe_ffn * topk + shared_ffn) if is_moe else dense_ffn for is_moe in moe_flags)

    attention_weights, attention_core = h * (q + 2 * k) + q * h, 6 * q
    if getattr(model, "multi_latent_attention", False):
        attention_weights, attention_core = _mla_attention_terms(model, h, heads)
    per_token = 6 * h * gated * ffn_width_sum + 6 * num_layers * attention_weights + 6 * h * vocab
    return float(B * s * per_token + attention_core * num_layers * B * s * s)


def _mla_attention_terms(model: Any, h: int, heads: int) -> tuple[int, int]:
    """Multi-latent attention's (projection weights a token multiplies through, s^2 coefficient): the query
    projection (or its down and up halves), the key/value down and up projections, the output projection; the
    causal core's Q.K^T over ``qk_head_dim + qk_pos_emb_head_dim`` and P.V over ``v_head_dim`` channels."""
    q_head = int(model.qk_head_dim) + int(model.qk_pos_emb_head_dim)
    v_head = int(model.v_head_dim)
    kv_rank = int(model.kv_lora_rank)
    q_rank = model.q_lora_rank
    query = h * heads * q_head if q_rank is None else int(q_rank) * (h + heads * q_head)
    key_value = h * (kv_rank + int(model.qk_pos_emb_head_dim)) + kv_rank * heads * (int(model.qk_head_dim) + v_head)
    return query + key_value + heads * v_head * h, 3 * heads * (q_head + v_head)
