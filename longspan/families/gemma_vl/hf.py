"""Gemma 3's vision-language model (``Gemma3ForConditionalGeneration``): config translation and weight table.

config.json nests the language model under ``text_config`` (a Gemma 3 text model, translated as
``Gemma3ForCausalLM``) and the SigLIP encoder under ``vision_config``; the image tokens are
``image_token_index`` / ``boi_token_index`` / ``eoi_token_index``. Weights: the language model under
``language_model.``, the encoder under ``vision_tower.`` and the projector under ``multi_modal_projector.``
(transformers' module paths and the hub's ``vision_tower.vision_model.`` read through the prefix aliases).
"""

from __future__ import annotations

from typing import Any

import longspan.conversion.mapping as mapping
from longspan.conversion.families import Family
from longspan.core.errors import NotSupportedError
from longspan.families.gemma.hf import GEMMA, gemma3_hf, gemma3_provider
from longspan.families.gemma_vl.provider import Gemma3VLModelProvider

#: vision_config keys the SigLIP encoder reads (the others, e.g. transformers' bookkeeping, are not kept)
SIGLIP_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_channels",
                 "image_size", "patch_size", "layer_norm_eps", "hidden_act", "attention_dropout", "vision_use_head")


def gemma3_vlm_provider(cfg: dict[str, Any]) -> dict[str, Any]:
    """Gemma3VLModelProvider fields of a Gemma3ForConditionalGeneration config.json: the language model from
    its ``text_config``, the SigLIP encoder from ``vision_config``, the image tokens."""
    out = gemma3_provider(gemma3_vlm_text_config(cfg))
    vision = dict(cfg.get("vision_config") or {})
    if not vision:
        raise NotSupportedError("config.json of Gemma3ForConditionalGeneration has no vision_config to convert")
    if vision.get("vision_use_head"):
        raise NotSupportedError("config.json vision_config.vision_use_head=true is not supported: Gemma 3 uses "
                                "every patch vector (false)")
    out.update(
        vision_config={k: vision[k] for k in SIGLIP_FIELDS if k in vision},
        mm_tokens_per_image=int(cfg.get("mm_tokens_per_image", 256)),
        image_token_id=int(_first(cfg, "image_token_index", "image_token_id", default=262144)),
        vision_start_token_id=int(_first(cfg, "boi_token_index", "boi_token_id", default=255999)),
        vision_end_token_id=int(_first(cfg, "eoi_token_index", "eoi_token_id", default=256000)),
    )
    text = cfg.get("text_config") or {}
    for key in ("bos_token_id", "eos_token_id"):
        value = cfg.get(key, text.get(key))
        if value is not None:
            out[key] = value
    return out


def _first(cfg: dict[str, Any], *keys: str, default: Any) -> Any:
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    return default


def gemma3_vlm_hf(p: Any) -> dict[str, Any]:
    """A Gemma3ForConditionalGeneration config.json body for a Gemma3VLModelProvider."""
    if not isinstance(p, Gemma3VLModelProvider) or not p.vision_config:
        raise NotSupportedError("this model has no vision encoder: export it as Gemma3ForCausalLM")
    text = dict(gemma3_hf(p), model_type="gemma3_text")
    vision = dict(p.vision_config, model_type="siglip_vision_model", vision_use_head=False)
    return dict(text_config=text, vision_config=vision, mm_tokens_per_image=p.mm_tokens_per_image,
                image_token_index=p.image_token_id, boi_token_index=p.vision_start_token_id,
                eoi_token_index=p.vision_end_token_id, tie_word_embeddings=text["tie_word_embeddings"],
                initializer_range=text["initializer_range"])


def gemma3_vlm_text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A Gemma3ForCausalLM config.json for the text tower of a Gemma3ForConditionalGeneration one."""
    text = dict(cfg.get("text_config") or {})
    if not text:
        raise NotSupportedError("config.json of Gemma3ForConditionalGeneration has no text_config to convert")
    dtype = cfg.get("dtype") or cfg.get("torch_dtype") or text.get("dtype") or text.get("torch_dtype")
    text.pop("torch_dtype", None)
    if dtype is not None:
        text["dtype"] = dtype
    text.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", True))
    return dict(text, architectures=["Gemma3ForCausalLM"], model_type="gemma3_text")


# The text tower of Gemma3ForConditionalGeneration as the hub's files and transformers' save_pretrained name it
# (transformers' modules are model.language_model.*: HFCheckpointReader's prefix aliases find files named so).
GEMMA3_TEXT_TOWER = mapping.with_prefix(mapping.with_prefix(GEMMA, "model.", "language_model.model."), "lm_head.",
                                       "language_model.lm_head.")


def _same(name: str) -> mapping.WeightMap:
    """A tensor longspan names as HF does (the SigLIP encoder and Gemma 3's projector keep HF's module names)."""
    return mapping.WeightMap(name, name)


_SIGLIP_LAYER = tuple(
    _same(f"vision_tower.encoder.layers.{{i}}.{module}.{kind}")
    for module in ("layer_norm1", "layer_norm2", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                   "self_attn.out_proj", "mlp.fc1", "mlp.fc2")
    for kind in ("weight", "bias")
)

# SigLIP's vision encoder under vision_tower.* (transformers 5's save_pretrained names; the hub's files add
# vision_model., which the family's prefix aliases read).
SIGLIP_VISION_TOWER = _SIGLIP_LAYER + tuple(_same(f"vision_tower.{n}") for n in (
    "embeddings.patch_embedding.weight", "embeddings.patch_embedding.bias", "embeddings.position_embedding.weight",
    "post_layernorm.weight", "post_layernorm.bias"))

# Gemma3ForConditionalGeneration: the language model (longspan's GPTModel under language_model.), the SigLIP
# encoder and the multimodal projector (its projection stored [vision_hidden, text_hidden], as ours).
GEMMA3_VLM = mapping.with_ours_prefix(GEMMA3_TEXT_TOWER, "language_model.") + SIGLIP_VISION_TOWER + (
    _same("multi_modal_projector.mm_input_projection_weight"),
    _same("multi_modal_projector.mm_soft_emb_norm.weight"),
)

#: other spellings of Gemma3ForConditionalGeneration's tensor names: transformers' module paths and the hub's
#: files (whose vision encoder sits under vision_tower.vision_model.)
GEMMA3_VLM_ALIASES = (("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."),
                      ("vision_tower.", "vision_tower.vision_model."), ("vision_tower.", "model.vision_tower."),
                      ("multi_modal_projector.", "model.multi_modal_projector."))

GEMMA3_VLM_FAMILY = Family("gemma3_vlm", "Gemma3ForConditionalGeneration", "gemma3", GEMMA3_VLM, gemma3_vlm_provider,
                           gemma3_vlm_hf, Gemma3VLModelProvider, hf_prefix_aliases=GEMMA3_VLM_ALIASES)
