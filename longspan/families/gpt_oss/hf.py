"""GPT-OSS (``GptOssForCausalLM``): config translation and weight table.

GPT-OSS is a Llama-shaped MoE with: learned attention sinks (``softmax_type='learnable'``, HF ``sinks``),
biases on q/k/v/o, the experts and the router (``add_bias_linear``), experts with a clamped SwiGLU
``(clamp(up, ±limit) + 1) * quick_gelu(clamp(gate, max=limit))`` (``activation_func=quick_gelu``,
``glu_linear_offset=1.0``, ``activation_func_clamp_value=swiglu_limit``; HF's ``swiglu_alpha`` must be 1.702,
quick_gelu's constant), top-k on the router logits then softmax over the chosen ones
(``moe_router_pre_softmax=False``), YaRN RoPE and alternating sliding/full layers (``layer_types``).

HF stores the experts stacked: ``gate_up_proj [E, hidden, 2 * ffn]`` with gate and up interleaved along the
last dim (gate = even columns, up = odd), ``gate_up_proj_bias [E, 2 * ffn]`` likewise, ``down_proj [E, ffn,
hidden]`` and ``down_proj_bias [E, hidden]``; longspan's slabs are ``[E, out, in]``. Released checkpoints hold
the expert matrices in MXFP4 (``{name}_blocks`` uint8 ``[E, out, in / 32, 16]``, two 4-bit E2M1 codes per
byte, low nibble first, and ``{name}_scales`` uint8 ``[E, out, in / 32]``, a power-of-two exponent + 127 per
32 values), already ``[E, out, in]``; the import decodes them as transformers does (``conversion.mxfp4``).
Export writes plain tensors in the model's dtype.
"""

from __future__ import annotations

from typing import Any

from longspan.conversion.config_fields import (
    dtype_fields,
    required,
    rope_fields,
    rope_hf,
    vocab_divisor,
    window_fields,
    window_hf,
)
from longspan.conversion.families import Family
from longspan.conversion.mapping import DECODER_ATTENTION, DECODER_EMBEDDINGS, layer_map
from longspan.core.errors import NotSupportedError
from longspan.models.activations import quick_gelu

QUICK_GELU_ALPHA = 1.702

WEIGHTS = DECODER_EMBEDDINGS + DECODER_ATTENTION + (
    layer_map("self_attention.softmax_offset", "self_attn.sinks"),
    layer_map("mlp.router.weight", "mlp.router.weight"),
    layer_map("mlp.router.bias", "mlp.router.bias"),
    layer_map("mlp.experts.linear_fc1_gate.weight", "mlp.experts.gate_up_proj", stacked=True, transpose=True,
              interleave=(0, 2), mxfp4=True),
    layer_map("mlp.experts.linear_fc1.weight", "mlp.experts.gate_up_proj", stacked=True, transpose=True,
              interleave=(1, 2), mxfp4=True),
    layer_map("mlp.experts.linear_fc1_gate.bias", "mlp.experts.gate_up_proj_bias", stacked=True, interleave=(0, 2)),
    layer_map("mlp.experts.linear_fc1.bias", "mlp.experts.gate_up_proj_bias", stacked=True, interleave=(1, 2)),
    layer_map("mlp.experts.linear_fc2.weight", "mlp.experts.down_proj", stacked=True, transpose=True, mxfp4=True),
    layer_map("mlp.experts.linear_fc2.bias", "mlp.experts.down_proj_bias", stacked=True),
)


def gpt_oss_provider(cfg: dict[str, Any]) -> dict[str, Any]:
    """GPTModelProvider fields for a GPT-OSS config.json dict."""
    alpha = float(cfg.get("swiglu_alpha", QUICK_GELU_ALPHA))
    if alpha != QUICK_GELU_ALPHA:
        raise NotSupportedError(f"config.json swiglu_alpha={alpha!r} is not supported: longspan's experts use "
                                f"quick_gelu ({QUICK_GELU_ALPHA})")
    if not cfg.get("attention_bias", True):
        raise NotSupportedError("config.json attention_bias=false is not supported for GPT-OSS (its experts and "
                                "router have biases, which longspan ties to add_bias_linear)")
    heads = required(cfg, "num_attention_heads")
    vocab = required(cfg, "vocab_size")
    layers = required(cfg, "num_hidden_layers")
    ffn = required(cfg, "intermediate_size")
    out: dict[str, Any] = dict(
        num_layers=layers,
        hidden_size=required(cfg, "hidden_size"),
        ffn_hidden_size=ffn,
        num_attention_heads=heads,
        num_query_groups=cfg.get("num_key_value_heads") or heads,
        kv_channels=cfg.get("head_dim") or required(cfg, "hidden_size") // heads,
        seq_length=cfg.get("max_position_embeddings", 4096),
        vocab_size=vocab,
        make_vocab_size_divisible_by=vocab_divisor(vocab),
        normalization="RMSNorm",
        layernorm_epsilon=float(cfg.get("rms_norm_eps", 1e-5)),
        gated_linear_unit=True,
        activation_func=quick_gelu,
        glu_linear_offset=1.0,
        activation_func_clamp_value=float(cfg.get("swiglu_limit", 7.0)),
        add_bias_linear=True,
        add_qkv_bias=True,
        softmax_type="learnable",
        share_embeddings_and_output_weights=bool(cfg.get("tie_word_embeddings", False)),
        attention_dropout=float(cfg.get("attention_dropout", 0.0)),
        hidden_dropout=0.0,
        init_method_std=float(cfg.get("initializer_range", 0.02)),
        num_moe_experts=required(cfg, "num_local_experts"),
        moe_router_topk=cfg.get("num_experts_per_tok", 4),
        moe_ffn_hidden_size=ffn,
        moe_router_pre_softmax=False,
        moe_router_load_balancing_type="aux_loss" if cfg.get("output_router_logits") else "none",
        moe_aux_loss_coeff=float(cfg.get("router_aux_loss_coef", 0.0)) if cfg.get("output_router_logits") else 0.0,
    )
    out.update(rope_fields(cfg))
    out.update(window_fields(cfg.get("sliding_window"), cfg.get("layer_types"), layers))
    out.update(dtype_fields(cfg))
    return out


def gpt_oss_hf(p: Any) -> dict[str, Any]:
    """config.json dict (without architectures/model_type/dtype) of a GPT-OSS-shaped provider."""
    if (p.activation_func is not quick_gelu or not p.gated_linear_unit or p.glu_linear_offset != 1.0
            or p.softmax_type != "learnable" or not p.add_bias_linear or not p.num_moe_experts
            or p.moe_router_pre_softmax or p.moe_shared_expert_intermediate_size
            or p.moe_layer_freq not in (1, [1] * p.num_layers) or p.normalization != "RMSNorm"):
        raise NotSupportedError("this model has no GPT-OSS equivalent (needs quick_gelu experts with "
                                "glu_linear_offset=1, learnable attention sinks, biases, every layer MoE)")
    window, layer_types = window_hf(p)
    out = dict(
        vocab_size=p.vocab_size,
        hidden_size=p.hidden_size,
        intermediate_size=p.moe_ffn_hidden_size or p.ffn_hidden_size,
        num_hidden_layers=p.num_layers,
        num_attention_heads=p.num_attention_heads,
        num_key_value_heads=p.num_query_groups or p.num_attention_heads,
        head_dim=p.kv_channels or p.hidden_size // p.num_attention_heads,
        max_position_embeddings=p.seq_length,
        rms_norm_eps=p.layernorm_epsilon,
        hidden_act="silu",
        tie_word_embeddings=bool(p.share_embeddings_and_output_weights),
        attention_dropout=float(p.attention_dropout),
        initializer_range=float(p.init_method_std),
        attention_bias=True,
        num_local_experts=p.num_moe_experts,
        num_experts_per_tok=p.moe_router_topk,
        swiglu_alpha=QUICK_GELU_ALPHA,
        swiglu_limit=float(p.activation_func_clamp_value) if p.activation_func_clamp_value is not None else 1e30,
        sliding_window=window,
        layer_types=layer_types,
        router_aux_loss_coef=float(_first(p.moe_aux_loss_coeff)),
        output_router_logits=p.moe_router_load_balancing_type == "aux_loss",
    )
    out.update(rope_hf(p))
    return out


def _first(value: Any) -> Any:
    return value[0] if isinstance(value, (list, tuple)) else value


GPT_OSS = Family("gpt_oss", "GptOssForCausalLM", "gpt_oss", WEIGHTS, gpt_oss_provider, gpt_oss_hf)
