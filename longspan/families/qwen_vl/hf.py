"""Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``): config translation and weight table.

config.json nests the language model's fields under ``text_config`` (transformers 5) or keeps them at the top
(the hub's original files); the vision encoder's are under ``vision_config``. The language model is a Qwen2
decoder whose RoPE has mRoPE sections (``rope_parameters.mrope_section``, or ``rope_scaling`` with type
'mrope' in the older spelling). Weights: the files (the hub's, and transformers' save_pretrained) name them
``model.*`` (the language model), ``visual.*`` (encoder and merger) and ``lm_head.*``; transformers' module
paths ``model.language_model.*`` / ``model.visual.*`` are read too (the family's prefix aliases).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import longspan.conversion.mapping as mapping
from longspan.conversion.config_fields import required
from longspan.conversion.decoder_fields import provider_view
from longspan.conversion.families import Family
from longspan.core.errors import NotSupportedError
from longspan.families.qwen.hf import qwen2_hf, qwen2_provider
from longspan.families.qwen_vl.provider import Qwen25VLModelProvider
from longspan.families.qwen_vl.vision import QwenVisionArgs

TOKEN_ID_FIELDS = ("bos_token_id", "eos_token_id", "vision_start_token_id", "vision_end_token_id",
                   "vision_token_id", "image_token_id", "video_token_id")


def _text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The language model's config.json fields, nested or at the top."""
    text = cfg.get("text_config")
    return dict(text) if text else dict(cfg)


def _mrope(text: dict[str, Any], cfg: dict[str, Any]) -> tuple[list[int], float]:
    """(mrope_section, rope_theta) from either spelling."""
    params = dict(text.get("rope_parameters") or text.get("rope_scaling") or cfg.get("rope_scaling") or {})
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", "mrope"):
        raise NotSupportedError(f"config.json rope_type={kind!r} is not supported for Qwen2.5-VL: it has "
                                "mRoPE without frequency scaling")
    sections = params.get("mrope_section")
    if sections is None:
        raise NotSupportedError("config.json has no mrope_section (rope_parameters / rope_scaling): Qwen2.5-VL's "
                                "multimodal RoPE needs it")
    theta = params.get("rope_theta", text.get("rope_theta", cfg.get("rope_theta", 1000000.0)))
    return [int(n) for n in sections], float(theta)


def qwen25_vl_provider(cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json dict -> ``Qwen25VLModelProvider`` keyword arguments."""
    text = _text_config(cfg)
    sections, theta = _mrope(text, cfg)
    plain = dict(text, rope_parameters={"rope_type": "default", "rope_theta": theta}, rope_scaling=None)
    for key in ("dtype", "torch_dtype", "tie_word_embeddings"):
        if cfg.get(key) is not None:
            plain[key] = cfg[key]

    out = qwen2_provider(plain)
    out.update(position_embedding_type="mrope", mrope_section=sections)
    vision = required(cfg, "vision_config")
    # every encoder field spelled out (HF's nested rope_parameters read), one-line error for one longspan
    # cannot build
    resolved = dataclasses.asdict(QwenVisionArgs.from_dict(vision))
    out["vision_config"] = dict(resolved, fullatt_block_indexes=list(resolved["fullatt_block_indexes"]))
    for key in TOKEN_ID_FIELDS:
        value = cfg.get(key, text.get(key))
        if isinstance(value, int):
            out[key] = value
    return out


def qwen25_vl_hf(p: Any) -> dict[str, Any]:
    """``Qwen25VLModelProvider`` -> config.json dict (transformers 5's nested spelling)."""
    text = qwen2_hf(provider_view(p, position_embedding_type="rope"))
    params = {"rope_type": "default", "rope_theta": float(p.rotary_base), "mrope_section": list(p.mrope_section)}
    text.update(rope_parameters=params, rope_scaling=None, rope_theta=params["rope_theta"],
                model_type="qwen2_5_vl_text")
    vision = dict(p.vision_config, model_type="qwen2_5_vl_vision")
    tokens = {key: getattr(p, key) for key in TOKEN_ID_FIELDS}
    return {"text_config": text, "vision_config": vision, "tie_word_embeddings": text["tie_word_embeddings"],
            **tokens}


def _nested(table: tuple[mapping.WeightMap, ...]) -> tuple[mapping.WeightMap, ...]:
    """A text model's table with our names moved under ``language_model`` (the files keep the text model's)."""
    return tuple(dataclasses.replace(e, ours="language_model." + e.ours) for e in table)


_VISION_BLOCK = ("norm1.weight", "norm2.weight", "attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight",
                 "attn.proj.bias", "mlp.gate_proj.weight", "mlp.gate_proj.bias", "mlp.up_proj.weight",
                 "mlp.up_proj.bias", "mlp.down_proj.weight", "mlp.down_proj.bias")
_MERGER = ("ln_q.weight", "mlp.0.weight", "mlp.0.bias", "mlp.2.weight", "mlp.2.bias")

QWEN25_VL = _nested(mapping.DECODER) + (
    mapping.WeightMap("vision.patch_embed.proj.weight", "visual.patch_embed.proj.weight"),
    *(mapping.WeightMap(f"vision.blocks.{{i}}.{name}", f"visual.blocks.{{i}}.{name}") for name in _VISION_BLOCK),
    *(mapping.WeightMap(f"merger.{name}", f"visual.merger.{name}") for name in _MERGER),
)

#: the module paths of transformers >= 4.52 (``model.language_model.*``, ``model.visual.*``), which some
#: writers use as tensor names, as the reader's prefix aliases
QWEN25_VL_ALIASES = (("model.", "model.language_model."), ("visual.", "model.visual."))

QWEN25_VL_FAMILY = Family("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl", QWEN25_VL,
                          qwen25_vl_provider, qwen25_vl_hf, Qwen25VLModelProvider,
                          hf_prefix_aliases=QWEN25_VL_ALIASES)
