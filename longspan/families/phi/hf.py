"""Phi-3 / Phi-4 (``Phi3ForCausalLM``): the standard decoder with fused ``qkv_proj`` / ``gate_up_proj`` weights
and LongRoPE, as config.json and weights."""

from __future__ import annotations

from typing import Any

from longspan.conversion.config_fields import required, rope_scaling_kind, window_fields, window_hf
from longspan.conversion.decoder_fields import NO_WINDOW, decoder_hf, decoder_provider, provider_view
from longspan.conversion.families import Family
from longspan.conversion.mapping import DECODER_EMBEDDINGS, WeightMap, layer_map
from longspan.core.errors import NotSupportedError

# transformers' Phi3Config reads these rope_type spellings as LongRoPE, and its original_max_position_embeddings
# (top level, default 4096) overrides the rope dict's.
LONGROPE_ALIASES = ("su", "yarn", "longrope")
ORIGINAL_MAX_POSITIONS = 4096


def weight_table(heads: int, groups: int) -> tuple[WeightMap, ...]:
    """Phi-3's layout: the standard decoder's with fused ``qkv_proj`` ([q | k | v], grouped-query sizes) and
    ``gate_up_proj`` ([gate | up]), split into longspan's separate projections on import, fused on export."""
    qkv = (heads, groups, groups)
    return DECODER_EMBEDDINGS + (
        layer_map("input_layernorm.weight", "input_layernorm.weight"),
        layer_map("self_attention.linear_q.weight", "self_attn.qkv_proj.weight", split=(0, 3), split_units=qkv),
        layer_map("self_attention.linear_k.weight", "self_attn.qkv_proj.weight", split=(1, 3), split_units=qkv),
        layer_map("self_attention.linear_v.weight", "self_attn.qkv_proj.weight", split=(2, 3), split_units=qkv),
        layer_map("self_attention.linear_proj.weight", "self_attn.o_proj.weight"),
        layer_map("pre_mlp_layernorm.weight", "post_attention_layernorm.weight"),
        layer_map("mlp.linear_fc1_gate.weight", "mlp.gate_up_proj.weight", split=(0, 2)),
        layer_map("mlp.linear_fc1.weight", "mlp.gate_up_proj.weight", split=(1, 2)),
        layer_map("mlp.linear_fc2.weight", "mlp.down_proj.weight"),
    )


def phi3_weights(cfg: dict[str, Any]) -> tuple[WeightMap, ...]:
    """Phi-3's table for config.json ``cfg``: the fused qkv_proj's block sizes follow its head counts."""
    heads = cfg.get("num_attention_heads") or 1
    return weight_table(heads, cfg.get("num_key_value_heads") or heads)


def phi3_provider(cfg: dict[str, Any]) -> dict[str, Any]:
    """Provider keyword arguments of a Phi-3 config.json."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope_type = params.pop("type", None) or params.get("rope_type", "default")
    if rope_type in LONGROPE_ALIASES:
        rope_type = "longrope"
    if rope_type not in ("default", "longrope"):
        raise NotSupportedError(
            f"config.json rope_type={rope_type!r} is not supported for Phi-3: use 'default' or 'longrope' ('su')"
        )
    params["rope_type"] = rope_type
    resid, embd = cfg.get("resid_pdrop", 0.0), cfg.get("embd_pdrop", 0.0)
    if resid != embd:
        raise NotSupportedError(
            f"config.json resid_pdrop={resid} with embd_pdrop={embd}: longspan has one hidden_dropout for both"
        )
    original = cfg.get("original_max_position_embeddings") or ORIGINAL_MAX_POSITIONS
    hf = dict(cfg, rope_parameters=params, rope_scaling=None, original_max_position_embeddings=original,
              attention_bias=False, mlp_bias=False, sliding_window=None)
    out = dict(decoder_provider(hf, eps_default=1e-5, family="Phi-3"), hidden_dropout=float(resid))
    # transformers' Phi-3 windows every layer when sliding_window is set
    return dict(out, **window_fields(cfg.get("sliding_window"), None, required(cfg, "num_hidden_layers")))


def phi3_hf(p: Any) -> dict[str, Any]:
    """A Phi-3 config.json body for provider ``p``."""
    kind = rope_scaling_kind(p)
    if kind not in ("default", "longrope"):
        raise NotSupportedError(f"Phi-3 takes default or longrope RoPE, not {kind}: export it as an architecture "
                                "with that scaling")
    if p.add_qkv_bias:
        raise NotSupportedError("Phi-3 has no linear biases: export it as an architecture with q/k/v biases")
    out = decoder_hf(provider_view(p, **NO_WINDOW), family="Phi-3")
    for key in ("attention_bias", "mlp_bias"):
        if out.pop(key):
            raise NotSupportedError("Phi-3 has no linear biases: export it as an architecture that has them")
    window, layer_types = window_hf(p)
    if window is not None and "full_attention" in layer_types:
        raise NotSupportedError("Phi-3 windows every layer or none: this model mixes windowed and full layers")
    original = p.rope_original_max_position_embeddings if kind == "longrope" else p.seq_length
    dropout = float(p.hidden_dropout)
    return dict(out, resid_pdrop=dropout, embd_pdrop=dropout, original_max_position_embeddings=int(original),
                sliding_window=window)


PHI3 = Family("phi3", "Phi3ForCausalLM", "phi3", weight_table(1, 1), phi3_provider, phi3_hf,
              weights_for=phi3_weights)
