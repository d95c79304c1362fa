"""Gemma 2 (``Gemma2ForCausalLM``) and Gemma 3's text model (``Gemma3ForCausalLM``) as config.json and weights.

Zero-centred RMSNorm ``x * (1 + w)`` before and after attention and the MLP, embeddings scaled by sqrt(hidden),
GeGLU with tanh GeLU, ``query_pre_attn_scalar`` as the softmax scale, tied embeddings, sliding-window layers
between global ones. Gemma 2 soft-caps attention scores and the final logits; Gemma 3 has per-head QK-norm and
a RoPE base per layer kind (sliding-window layers 10k, global layers 1M with their own linear scaling).
"""

from __future__ import annotations

from typing import Any

from longspan.conversion.config_fields import _whole, hf_activation, required, rope_fields, rope_hf
from longspan.conversion.decoder_fields import activation_func, decoder_shape, decoder_shape_hf
from longspan.conversion.families import Family
from longspan.conversion.hf_fields import HFField, export_fields, import_fields
from longspan.conversion.mapping import (
    DECODER_EMBEDDINGS,
    DECODER_MLP,
    DECODER_QKVO,
    POST_SUBLAYER_NORMS,
    layer_map,
)
from longspan.core.errors import NotSupportedError
from longspan.models.layer_pattern import (
    layer_types_from_windows,
    layer_windows,
    window_pattern_from_layer_types,
)

# Norms before and after attention and the MLP (HF's post_attention_layernorm is the norm after attention).
GEMMA = DECODER_EMBEDDINGS + DECODER_QKVO + POST_SUBLAYER_NORMS + DECODER_MLP[:3] + (
    layer_map("input_layernorm.weight", "input_layernorm.weight"),
    layer_map("pre_mlp_layernorm.weight", "pre_feedforward_layernorm.weight"),
)

GEMMA3_ROPE_TYPES = ("default", "linear")

# Gemma 2's soft-caps of the attention scores and the final logits (null = none).
_SOFTCAPS = (
    HFField("attn_logit_softcapping", "attn_logit_softcapping", default=None),
    HFField("final_logit_softcapping", "final_logit_softcapping", default=None),
)


def _gemma_common(cfg: dict[str, Any]) -> dict[str, Any]:
    if cfg.get("use_bidirectional_attention"):
        raise NotSupportedError(
            "config.json use_bidirectional_attention=true is not supported: longspan's Gemma is causal (false)"
        )
    out = decoder_shape(cfg, eps_default=1e-6)
    scalar = cfg.get("query_pre_attn_scalar")
    out.update(
        layernorm_zero_centered_gamma=True,
        layernorm_after_sublayers=True,
        apply_embedding_scaling=True,
        # HF's hidden_activation (older files also carry hidden_act, which Gemma ignores)
        activation_func=activation_func(cfg, "hidden_activation", "gelu_pytorch_tanh"),
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
    out = decoder_shape_hf(p)
    out.update(hidden_activation={"gelu_new": "gelu_pytorch_tanh"}.get(hf_activation(p), hf_activation(p)),
               query_pre_attn_scalar=_query_pre_attn_scalar(p))
    out.update(_sliding_window_hf(p))
    return out


def gemma2_provider(cfg: dict[str, Any]) -> dict[str, Any]:
    """Provider keyword arguments of a Gemma 2 config.json."""
    out = _gemma_common(cfg)
    out.update(rope_fields(cfg))
    out.update(import_fields(_SOFTCAPS, cfg))
    return out


def gemma2_hf(p: Any) -> dict[str, Any]:
    """A Gemma 2 config.json body for provider ``p``."""
    if p.qk_layernorm or isinstance(p.rotary_base, (list, tuple)):
        raise NotSupportedError("Gemma 2 has no QK-norm and one RoPE base: export this model as Gemma 3")
    out = _gemma_hf(p, "Gemma 2")
    out.update(rope_hf(p))
    for key in ("rope_theta", "rope_scaling"):  # Gemma 2's config takes rope_parameters only
        out.pop(key)
    return dict(out, **export_fields(_SOFTCAPS, p))


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
    """Provider keyword arguments of a Gemma 3 text config.json."""
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
    """A Gemma 3 text config.json body for provider ``p``."""
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


GEMMA2 = Family("gemma2", "Gemma2ForCausalLM", "gemma2", GEMMA, gemma2_provider, gemma2_hf)
GEMMA3 = Family("gemma3", "Gemma3ForCausalLM", "gemma3_text", GEMMA, gemma3_provider, gemma3_hf)
