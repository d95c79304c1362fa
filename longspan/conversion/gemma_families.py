"""Config translations of Gemma 2, Gemma 3 (text) and OLMo-2: the decoders whose norms sit after attention and
the MLP.

- Gemma 2/3: zero-centred RMSNorm ``x * (1 + w)`` before and after attention and the MLP, embeddings scaled by
  sqrt(hidden), GeGLU with tanh GeLU, ``query_pre_attn_scalar`` as the softmax scale, tied embeddings.
  Gemma 2 soft-caps attention scores and the final logits; Gemma 3 has per-head QK-norm and a RoPE base per
  layer kind (sliding-window layers 10k, global layers 1M with their own linear scaling).
- OLMo-2: plain RMSNorm only after attention and the MLP (``x + norm(attn(x))``) and a QK-norm over each
  token's whole query / key projection.
"""

from __future__ import annotations

from typing import Any

from longspan.conversion.config_fields import (
    HF_ACTIVATIONS,
    _whole,
    dtype_fields,
    hf_activation,
    required,
    rope_fields,
    rope_hf,
    vocab_divisor,
)
from longspan.core.errors import NotSupportedError
from longspan.models.layer_pattern import (
    layer_types_from_windows,
    layer_windows,
    window_pattern_from_layer_types,
)

GEMMA3_ROPE_TYPES = ("default", "linear")


def _decoder_shape(cfg: dict[str, Any], eps_default: float) -> dict[str, Any]:
    """The fields every family here shares (sizes, vocabulary, RMSNorm, gated MLP, no biases)."""
    if cfg.get("attention_bias"):
        raise NotSupportedError(
            f"config.json attention_bias=true is not supported for {cfg.get('model_type')}: longspan implements "
            "these models without linear biases (attention_bias=false)"
        )
    heads = required(cfg, "num_attention_heads")
    hidden = required(cfg, "hidden_size")
    vocab = required(cfg, "vocab_size")
    out: dict[str, Any] = dict(
        num_layers=required(cfg, "num_hidden_layers"),
        hidden_size=hidden,
        ffn_hidden_size=required(cfg, "intermediate_size"),
        num_attention_heads=heads,
        num_query_groups=cfg.get("num_key_value_heads") or heads,
        kv_channels=cfg.get("head_dim") or hidden // heads,
        seq_length=cfg.get("max_position_embeddings", 4096),
        vocab_size=vocab,
        make_vocab_size_divisible_by=vocab_divisor(vocab),
        normalization="RMSNorm",
        layernorm_epsilon=float(cfg.get("rms_norm_eps", eps_default)),
        gated_linear_unit=True,
        add_bias_linear=False,
        add_qkv_bias=False,
        attention_dropout=float(cfg.get("attention_dropout", 0.0) or 0.0),
        hidden_dropout=0.0,
        init_method_std=float(cfg.get("initializer_range", 0.02)),
    )
    out.update(dtype_fields(cfg))
    return out


def _activation(cfg: dict[str, Any], key: str, default: str) -> Any:
    act = cfg.get(key) or default
    if act not in HF_ACTIVATIONS:
        raise NotSupportedError(f"config.json {key}={act!r} is not supported: use one of {', '.join(HF_ACTIVATIONS)}")
    return HF_ACTIVATIONS[act]


def _shape_hf(p: Any) -> dict[str, Any]:
    return dict(
        vocab_size=p.vocab_size, hidden_size=p.hidden_size, intermediate_size=p.ffn_hidden_size,
        num_hidden_layers=p.num_layers, num_attention_heads=p.num_attention_heads,
        num_key_value_heads=p.num_query_groups or p.num_attention_heads,
        head_dim=p.kv_channels or p.hidden_size // p.num_attention_heads, max_position_embeddings=p.seq_length,
        rms_norm_eps=p.layernorm_epsilon, attention_bias=False, attention_dropout=float(p.attention_dropout),
        initializer_range=float(p.init_method_std), tie_word_embeddings=bool(p.share_embeddings_and_output_weights),
    )


# ------------------------------------------------------------------------------------------------ Gemma


def _gemma_common(cfg: dict[str, Any]) -> dict[str, Any]:
    if cfg.get("use_bidirectional_attention"):
        raise NotSupportedError(
            "config.json use_bidirectional_attention=true is not supported: longspan's Gemma is causal (false)"
        )
    out = _decoder_shape(cfg, eps_default=1e-6)
    scalar = cfg.get("query_pre_attn_scalar")
    out.update(
        layernorm_zero_centered_gamma=True,
        layernorm_after_sublayers=True,
        apply_embedding_scaling=True,
        # HF's hidden_activation (older files also carry hidden_act, which Gemma ignores)
        activation_func=_activation(cfg, "hidden_activation", "gelu_pytorch_tanh"),
        share_embeddings_and_output_weights=bool(cfg.get("tie_word_embeddings", True)),
        softmax_scale=None if scalar is None else float(scalar) ** -0.5,
    )
    out.update(_sliding_window_fields(cfg))
    return out


def _sliding_window_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """The sliding-window layers (``layer_types``; older files: Gemma 2 alternates from a sliding first layer,
    Gemma 3 has ``sliding_window_pattern``, default 6) and their window ``sliding_window`` (HF's W positions,
    the token itself included, is Megatron's ``window_size=[W - 1, 0]``)."""
    window = cfg.get("sliding_window")
    if not window:
        return {}
    layers = required(cfg, "num_hidden_layers")
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        every = 2 if cfg.get("model_type") == "gemma2" else int(cfg.get("sliding_window_pattern", 6))
        layer_types = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(layers)]
    if len(layer_types) != layers:
        raise NotSupportedError(
            f"config.json layer_types has {len(layer_types)} entries for num_hidden_layers={layers}: give one per layer"
        )
    return dict(window_size=[int(window) - 1, 0], window_attn_skip_freq=window_pattern_from_layer_types(layer_types))


def _sliding_window_hf(p: Any) -> dict[str, Any]:
    windows = layer_windows(p)
    sizes = {w for w in windows if w is not None}
    if len(sizes) > 1 or (p.window_size is not None and p.window_size[1] != 0):
        raise NotSupportedError(f"model.window_size={p.window_size!r} has no HF Gemma equivalent: use [W - 1, 0]")
    return dict(sliding_window=sizes.pop() if sizes else None, layer_types=layer_types_from_windows(windows))


def _query_pre_attn_scalar(p: Any) -> float | int:
    """HF's ``query_pre_attn_scalar`` (the softmax scale is its inverse square root)."""
    if p.softmax_scale is None:
        return p.kv_channels or p.hidden_size // p.num_attention_heads
    value = float(p.softmax_scale) ** -2
    return int(round(value)) if abs(value - round(value)) <= 1e-9 * value else value


def _check_gemma_provider(p: Any, name: str) -> None:
    ok = (p.normalization == "RMSNorm" and p.layernorm_zero_centered_gamma and p.layernorm_after_sublayers
          and p.layernorm_before_sublayers and p.apply_embedding_scaling and p.gated_linear_unit
          and not p.add_bias_linear and not p.add_qkv_bias and p.position_embedding_type == "rope"
          and hf_activation(p) is not None)
    if not ok:
        raise NotSupportedError(
            f"this model has no {name} equivalent (needs zero-centred RMSNorm before and after attention and the "
            "MLP, embedding scaling, RoPE, a gated MLP and no biases)"
        )


def _gemma_hf(p: Any, name: str) -> dict[str, Any]:
    _check_gemma_provider(p, name)
    out = _shape_hf(p)
    out.update(hidden_activation={"gelu_new": "gelu_pytorch_tanh"}.get(hf_activation(p), hf_activation(p)),
               query_pre_attn_scalar=_query_pre_attn_scalar(p))
    out.update(_sliding_window_hf(p))
    return out


def gemma2_provider(cfg: dict[str, Any]) -> dict[str, Any]:
    out = _gemma_common(cfg)
    out.update(rope_fields(cfg))
    out.update(attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
               final_logit_softcapping=cfg.get("final_logit_softcapping"))
    return out


def gemma2_hf(p: Any) -> dict[str, Any]:
    if p.qk_layernorm or isinstance(p.rotary_base, (list, tuple)):
        raise NotSupportedError("Gemma 2 has no QK-norm and one RoPE base: export this model as Gemma 3")
    out = _gemma_hf(p, "Gemma 2")
    out.update(rope_hf(p))
    for key in ("rope_theta", "rope_scaling"):  # Gemma 2's config takes rope_parameters only
        out.pop(key)
    return dict(out, attn_logit_softcapping=p.attn_logit_softcapping,
                final_logit_softcapping=p.final_logit_softcapping)


def _gemma3_rope_parameters(cfg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(local, global) RoPE parameters from transformers 5's per-layer-kind ``rope_parameters`` or the older
    ``rope_theta`` / ``rope_local_base_freq`` / ``rope_scaling``."""
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        return dict(params.get("sliding_attention") or {}), dict(params.get("full_attention") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    local = {"rope_type": "default", "rope_theta": cfg.get("rope_local_base_freq", 10_000.0)}
    return local, dict(scaling, rope_theta=params.get("rope_theta", cfg.get("rope_theta", 1_000_000.0)))


def _gemma3_rope_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    local, full = _gemma3_rope_parameters(cfg)
    for kind, params, allowed in (("sliding_attention", local, ("default",)),
                                  ("full_attention", full, GEMMA3_ROPE_TYPES)):
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in allowed:
            raise NotSupportedError(
                f"config.json rope_parameters.{kind}.rope_type={rope_type!r} is not supported: longspan implements "
                f"{' and '.join(repr(a) for a in allowed)} for Gemma 3's {kind} layers"
            )
    linear = full.get("rope_type", full.get("type", "default")) == "linear"
    return dict(
        position_embedding_type="rope",
        rotary_base=[_whole(local.get("rope_theta", 10_000.0)), _whole(full.get("rope_theta", 1_000_000.0))],
        rope_scaling=False,
        rope_scaling_factor=float(full["factor"]) if linear else 1.0,
    )


def gemma3_provider(cfg: dict[str, Any]) -> dict[str, Any]:
    if cfg.get("attn_logit_softcapping") or cfg.get("final_logit_softcapping"):
        raise NotSupportedError(
            "config.json attn_logit_softcapping / final_logit_softcapping are not supported for Gemma 3 (they are "
            "Gemma 2's): set them to null"
        )
    out = _gemma_common(cfg)
    out.update(_gemma3_rope_fields(cfg))
    out.update(qk_layernorm=True)
    return out


def gemma3_hf(p: Any) -> dict[str, Any]:
    if not p.qk_layernorm or p.qk_layernorm_across_heads or p.attn_logit_softcapping or p.final_logit_softcapping:
        raise NotSupportedError("Gemma 3 needs per-head qk_layernorm and no soft-capping")
    out = _gemma_hf(p, "Gemma 3")
    if isinstance(p.rotary_base, (list, tuple)):
        local_theta, global_theta = (float(b) for b in p.rotary_base)
        factor = float(p.rope_scaling_factor)
    else:
        local_theta = global_theta = float(p.rotary_base)
        factor = 1.0
    full = {"rope_type": "default", "rope_theta": global_theta}
    if factor != 1.0:
        full.update(rope_type="linear", factor=factor)
    out["rope_parameters"] = {"sliding_attention": {"rope_type": "default", "rope_theta": local_theta},
                              "full_attention": full}
    return out


# ------------------------------------------------------------------------------------------------ OLMo-2


def olmo2_provider(cfg: dict[str, Any]) -> dict[str, Any]:
    out = _decoder_shape(cfg, eps_default=1e-5)
    out.update(
        activation_func=_activation(cfg, "hidden_act", "silu"),
        share_embeddings_and_output_weights=bool(cfg.get("tie_word_embeddings", False)),
        layernorm_before_sublayers=False,
        layernorm_after_sublayers=True,
        qk_layernorm=True,
        qk_layernorm_across_heads=True,
    )
    out.update(rope_fields(cfg))
    return out


def olmo2_hf(p: Any) -> dict[str, Any]:
    ok = (p.normalization == "RMSNorm" and not p.layernorm_before_sublayers and p.layernorm_after_sublayers
          and p.qk_layernorm and p.qk_layernorm_across_heads and not p.layernorm_zero_centered_gamma
          and not p.apply_embedding_scaling and p.gated_linear_unit and not p.add_bias_linear
          and not p.add_qkv_bias and p.position_embedding_type == "rope" and hf_activation(p) is not None)
    if not ok:
        raise NotSupportedError(
            "this model has no OLMo-2 equivalent (needs RMSNorm only after attention and the MLP, QK-norm across "
            "heads, RoPE, a gated MLP and no biases)"
        )
    out = _shape_hf(p)
    out.update(hidden_act=hf_activation(p))
    out.update(rope_hf(p))
    return out
