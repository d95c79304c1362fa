"""Qwen3.5 / Qwen3.6 (``Qwen3_5ForCausalLM``, ``Qwen3_5MoeForCausalLM``, and the text towers of
``Qwen3_5ForConditionalGeneration`` / ``Qwen3_5MoeForConditionalGeneration``): config.json and weights. The
vision-language models import whole in ``longspan.families.qwen3_vl``, over this module's translation and tables;
a text run (a text recipe on such a directory) takes their text tower (``Family.text_tower``).

The decoder is Qwen3-Next's hybrid (``longspan.families.qwen3_next.hf``: the layer pattern, the gated DeltaNet
mixer, gated attention, (1 + w) norms, partial RoPE, the shared-expert MoE) with the DeltaNet's projections
stored apart: ``in_proj_qkv`` (rows ``[q | k | v]``, contiguous), ``in_proj_z``, ``in_proj_b``, ``in_proj_a``.
Qwen3.5-MoE has experts on every layer and always renormalises the top-k weights.
"""

from __future__ import annotations

from typing import Any

from longspan.conversion.config_fields import required
from longspan.conversion.families import Family
from longspan.conversion.hf_fields import export_fields, import_fields
from longspan.conversion.mapping import DECODER_EMBEDDINGS, WeightMap, with_prefix
from longspan.core.errors import NotSupportedError
from longspan.families.qwen3_next.hf import (
    MOE_FIELDS,
    layer_entry,
    check_moe,
    conv_entries,
    hybrid_hf,
    hybrid_provider,
    hybrid_weights,
    mixer_common,
    mixer_sizes,
    moe_flags,
)


def split_mixer(i: int, cfg: dict[str, Any]) -> tuple[WeightMap, ...]:
    """Qwen3.5's DeltaNet: ``in_proj_qkv`` split by sizes, ``in_proj_z`` / ``_b`` / ``_a`` one to one."""
    kh, vh, kd, vd = mixer_sizes(cfg)
    units = (kh * kd, kh * kd, vh * vd)
    table = [layer_entry(i, f"self_attention.linear_{part}.weight", "linear_attn.in_proj_qkv.weight", split=(j, 3),
                    split_units=units) for j, part in enumerate("qkv")]
    table += [layer_entry(i, f"self_attention.linear_{part}.weight", f"linear_attn.in_proj_{part}.weight")
              for part in "zba"]
    return (*table, *conv_entries(i, cfg), *mixer_common(i))


# ----------------------------------------------------------------------------------------------- dense

def qwen35_provider(cfg: dict[str, Any]) -> dict[str, Any]:
    """Provider keyword arguments of a Qwen3.5 (dense) config.json."""
    return hybrid_provider(cfg, family="Qwen3.5")


def qwen35_hf(p: Any) -> dict[str, Any]:
    """A Qwen3.5 config.json body for provider ``p``."""
    if p.num_moe_experts:
        raise NotSupportedError("this model has experts: export it as Qwen3_5MoeForCausalLM")
    return hybrid_hf(p, "Qwen3.5")


def qwen35_weights(cfg: dict[str, Any]) -> tuple[WeightMap, ...]:
    """Qwen3.5's weight table for config.json dict ``cfg``."""
    return hybrid_weights(cfg, split_mixer, [0] * int(required(cfg, "num_hidden_layers")))


# ----------------------------------------------------------------------------------------------- MoE

def qwen35_moe_provider(cfg: dict[str, Any]) -> dict[str, Any]:
    """Provider keyword arguments of a Qwen3.5-MoE config.json (experts on every layer; ``intermediate_size``
    is not a Qwen3.5-MoE key: the dense width is the experts')."""
    width = cfg.get("moe_intermediate_size", 512)
    out = hybrid_provider(dict(cfg, intermediate_size=cfg.get("intermediate_size") or width), family="Qwen3.5-MoE")
    out.update(import_fields(MOE_FIELDS, dict(cfg, num_experts=cfg.get("num_experts", 256),
                                              num_experts_per_tok=cfg.get("num_experts_per_tok", 8))))
    out.update(moe_layer_freq=1, moe_shared_expert_gate=True, moe_router_pre_softmax=False,
               moe_router_load_balancing_type="aux_loss")
    return out


def qwen35_moe_hf(p: Any) -> dict[str, Any]:
    """A Qwen3.5-MoE config.json body for provider ``p``."""
    check_moe(p, "Qwen3.5-MoE")
    if not p.num_moe_experts or not all(moe_flags(p)) or p.moe_router_pre_softmax:
        raise NotSupportedError("Qwen3.5-MoE needs experts on every layer (moe_layer_freq=1) with top-k weights "
                                "renormalised (moe_router_pre_softmax=False)")
    out = hybrid_hf(p, "Qwen3.5-MoE")
    out.pop("intermediate_size")
    out.update(export_fields(MOE_FIELDS, p))
    return out


def qwen35_moe_weights(cfg: dict[str, Any]) -> tuple[WeightMap, ...]:
    """Qwen3.5-MoE's weight table for config.json dict ``cfg``."""
    return hybrid_weights(cfg, split_mixer, [1] * int(required(cfg, "num_hidden_layers")))


# ----------------------------------------------------------------------------------------------- text towers

def text_config(cfg: dict[str, Any], architecture: str, model_type: str) -> dict[str, Any]:
    """The causal LM's config.json for the text tower of a vision-language one (its ``text_config``, with the
    top level's dtype and tied embeddings)."""
    text = dict(cfg.get("text_config") or {})
    if not text:
        raise NotSupportedError(f"config.json of {cfg.get('architectures')} has no text_config to convert")
    for key in ("dtype", "torch_dtype", "tie_word_embeddings"):
        if cfg.get(key) is not None:
            text[key] = cfg[key]
    dtype = text.pop("torch_dtype", None)
    text.setdefault("dtype", dtype)
    return dict(text, architectures=[architecture], model_type=model_type)


def _tower(causal: Family, architecture: str, model_type: str) -> Family:
    """The text tower of vision-language ``architecture`` as ``causal``'s translation, tables under
    ``model.language_model.*``; it exports as ``causal``."""

    def to_provider(cfg: dict[str, Any]) -> dict[str, Any]:
        return causal.to_provider(text_config(cfg, causal.architecture, causal.model_type))

    def to_hf(p: Any) -> dict[str, Any]:
        raise NotSupportedError(f"longspan imports only the text tower of {architecture}: export it as "
                                f"{causal.architecture}")

    def weights_for(cfg: dict[str, Any]) -> tuple[WeightMap, ...]:
        table = causal.weights_for(text_config(cfg, causal.architecture, causal.model_type))
        return with_prefix(table, "model.", "model.language_model.")

    def export_config(cfg: dict[str, Any]) -> dict[str, Any]:
        return text_config(cfg, causal.architecture, causal.model_type)

    return Family(f"{causal.name}_vl_text", architecture, model_type, with_prefix(DECODER_EMBEDDINGS, "model.",
                  "model.language_model."), to_provider, to_hf, weights_for=weights_for,
                  export_architecture=causal.architecture, export_config=export_config)


QWEN35 = Family("qwen35", "Qwen3_5ForCausalLM", "qwen3_5_text", DECODER_EMBEDDINGS, qwen35_provider, qwen35_hf,
                weights_for=qwen35_weights)
QWEN35_MOE = Family("qwen35_moe", "Qwen3_5MoeForCausalLM", "qwen3_5_moe_text", DECODER_EMBEDDINGS,
                    qwen35_moe_provider, qwen35_moe_hf, weights_for=qwen35_moe_weights)
QWEN35_VL_TEXT = _tower(QWEN35, "Qwen3_5ForConditionalGeneration", "qwen3_5")
QWEN35_MOE_VL_TEXT = _tower(QWEN35_MOE, "Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe")
