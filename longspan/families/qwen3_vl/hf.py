"""Qwen3-VL (``Qwen3VLForConditionalGeneration``, ``Qwen3VLMoeForConditionalGeneration``): config translation
and weight tables.

config.json nests the language model's fields under ``text_config`` (a Qwen3 or Qwen3-MoE decoder whose
``rope_parameters`` carry ``mrope_section``; the sections are always interleaved) and the encoder's under
``vision_config``. Weights: ``model.language_model.*`` (the decoder), ``model.visual.*`` (encoder, merger,
DeepStack mergers) and ``lm_head.*``. The MoE files hold each layer's experts as two stacked tensors,
``experts.gate_up_proj [experts, 2 * moe_intermediate, hidden]`` and ``experts.down_proj [experts, hidden,
moe_intermediate]`` (transformers 5), or each expert's matrices transposed (the hub's releases, written by
transformers 4.x), which the table maps onto longspan's per-expert weights.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import longspan.conversion.mapping as mapping
from longspan.conversion.config_fields import required
from longspan.conversion.decoder_fields import provider_view
from longspan.conversion.families import Family
from longspan.core.errors import NotSupportedError
from longspan.families.qwen.hf import qwen3_hf, qwen3_moe_hf, qwen3_moe_provider, qwen3_provider
from longspan.families.qwen35.hf import (QWEN35_MOE_VL_TEXT, QWEN35_VL_TEXT, qwen35_hf, qwen35_moe_hf,
                                        qwen35_moe_provider, qwen35_moe_weights, qwen35_provider, qwen35_weights,
                                        text_config)
from longspan.families.qwen3_vl.provider import (Qwen35VLModelProvider, Qwen35VLMoEModelProvider, Qwen3VLModelProvider,
                                                Qwen3VLMoEModelProvider)
from longspan.families.qwen3_vl.vision import Qwen3VisionArgs

TOKEN_ID_FIELDS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


def _mrope(text: dict[str, Any], default_sections: list[int]) -> tuple[list[int], float]:
    """(mrope_section, rope_theta) of the text config's ``rope_parameters`` (transformers' default sections when
    it has none)."""
    params = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", "mrope"):
        raise NotSupportedError(f"config.json text_config.rope_parameters.rope_type={kind!r} is not supported for "
                                "Qwen3-VL: it has interleaved mRoPE without frequency scaling")
    sections = params.get("mrope_section") or default_sections
    theta = params.get("rope_theta", text.get("rope_theta", 5000000.0))
    return [int(n) for n in sections], float(theta)


def _provider(cfg: dict[str, Any], text_provider: Any, deepstack: bool = True) -> dict[str, Any]:
    text = dict(required(cfg, "text_config"))
    sections, theta = _mrope(text, [24, 20, 20] if deepstack else [11, 11, 10])
    params = {key: value for key, value in (text.get("rope_parameters") or {}).items()
              if key not in ("mrope_section", "mrope_interleaved", "type")}
    plain = dict(text, rope_parameters=dict(params, rope_type="default", rope_theta=theta), rope_scaling=None)
    for key in ("dtype", "torch_dtype", "tie_word_embeddings"):
        if cfg.get(key) is not None:
            plain[key] = cfg[key]
    out = text_provider(plain)
    out.update(position_embedding_type="mrope", mrope_section=sections)
    vision = dict(required(cfg, "vision_config"))
    if not deepstack:  # Qwen3.5's encoder has no DeepStack mergers
        vision["deepstack_visual_indexes"] = []
    resolved = dataclasses.asdict(Qwen3VisionArgs.from_dict(vision))
    out["vision_config"] = dict(resolved, deepstack_visual_indexes=list(resolved["deepstack_visual_indexes"]))
    for key in TOKEN_ID_FIELDS:
        if isinstance(cfg.get(key), int):
            out[key] = cfg[key]
    for key in ("bos_token_id", "eos_token_id"):
        value = text.get(key, cfg.get(key))
        if isinstance(value, int):
            out[key] = value
    return out


def _hf(p: Any, text_hf: Any, model_type: str, deepstack: bool = True) -> dict[str, Any]:
    text = text_hf(provider_view(p, position_embedding_type="rope"))
    for key in ("use_sliding_window", "sliding_window", "rope_scaling", "rope_theta"):
        text.pop(key, None)
    params = dict(text.get("rope_parameters") or {})
    params.update(rope_type="default", rope_theta=float(p.rotary_base), mrope_section=list(p.mrope_section),
                  mrope_interleaved=True)
    text.update(rope_parameters=params, model_type=f"{model_type}_text", bos_token_id=p.bos_token_id,
                eos_token_id=p.eos_token_id)
    if not deepstack and p.vision_config.get("deepstack_visual_indexes"):
        raise NotSupportedError(f"model.vision_config.deepstack_visual_indexes="
                                f"{p.vision_config['deepstack_visual_indexes']}: {model_type}'s encoder has no "
                                "DeepStack mergers; set it []")
    skip = ("rope_theta",) if deepstack else ("rope_theta", "deepstack_visual_indexes")
    vision = {key: value for key, value in p.vision_config.items() if key not in skip}
    vision.update(model_type=f"{model_type}_vision",
                  rope_parameters={"rope_type": "axial", "rope_theta": float(p.vision_config.get("rope_theta",
                                                                                                  10000.0))})
    tokens = {key: getattr(p, key) for key in TOKEN_ID_FIELDS}
    return {"text_config": text, "vision_config": vision, "tie_word_embeddings": text.pop("tie_word_embeddings"),
            **tokens}


def qwen3_vl_provider(cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json dict -> ``Qwen3VLModelProvider`` keyword arguments."""
    return _provider(cfg, qwen3_provider)


def qwen3_vl_hf(p: Any) -> dict[str, Any]:
    """``Qwen3VLModelProvider`` -> config.json dict."""
    return _hf(p, qwen3_hf, "qwen3_vl")


def _renormalized_moe_provider(text: dict[str, Any]) -> dict[str, Any]:
    # Qwen3-VL-MoE's router always renormalizes the top-k probabilities (its config has no norm_topk_prob)
    return qwen3_moe_provider(dict(text, norm_topk_prob=True))


def qwen3_vl_moe_provider(cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json dict -> ``Qwen3VLMoEModelProvider`` keyword arguments."""
    return _provider(cfg, _renormalized_moe_provider)


def qwen3_vl_moe_hf(p: Any) -> dict[str, Any]:
    """``Qwen3VLMoEModelProvider`` -> config.json dict."""
    if p.moe_router_pre_softmax:
        raise NotSupportedError("model.moe_router_pre_softmax=True (top-k weights not renormalized) has no "
                                "Qwen3VLMoeForConditionalGeneration spelling: its router always renormalizes; set "
                                "it False")
    out = _hf(p, qwen3_moe_hf, "qwen3_vl_moe")
    out["text_config"].pop("norm_topk_prob", None)
    return out


def _nested(table: tuple[mapping.WeightMap, ...]) -> tuple[mapping.WeightMap, ...]:
    """A text model's table with our names under ``language_model`` and HF's under ``model.language_model``."""
    moved = mapping.with_prefix(table, "model.", "model.language_model.")
    return tuple(dataclasses.replace(e, ours="language_model." + e.ours) for e in moved)


_BLOCK = ("norm1.weight", "norm1.bias", "norm2.weight", "norm2.bias", "attn.qkv.weight", "attn.qkv.bias",
          "attn.proj.weight", "attn.proj.bias", "mlp.linear_fc1.weight", "mlp.linear_fc1.bias",
          "mlp.linear_fc2.weight", "mlp.linear_fc2.bias")
_MERGER = ("norm.weight", "norm.bias", "linear_fc1.weight", "linear_fc1.bias", "linear_fc2.weight",
           "linear_fc2.bias")

VISION = (
    mapping.WeightMap("vision.patch_embed.proj.weight", "model.visual.patch_embed.proj.weight"),
    mapping.WeightMap("vision.patch_embed.proj.bias", "model.visual.patch_embed.proj.bias"),
    mapping.WeightMap("vision.pos_embed.weight", "model.visual.pos_embed.weight"),
    *(mapping.WeightMap(f"vision.blocks.{{i}}.{name}", f"model.visual.blocks.{{i}}.{name}") for name in _BLOCK),
    *(mapping.WeightMap(f"merger.{name}", f"model.visual.merger.{name}") for name in _MERGER),
    *(mapping.WeightMap(f"deepstack_mergers.{{i}}.{name}", f"model.visual.deepstack_merger_list.{{i}}.{name}")
      for name in _MERGER),
)

QWEN3_VL = _nested(mapping.DECODER) + VISION



def _moe_table(transposed: bool) -> tuple[mapping.WeightMap, ...]:
    """gate_up_proj ``[E, 2 * moe_intermediate, hidden]``: the gate's rows, then the up projection's; with
    ``transposed`` the files hold each expert's matrices as ``[in, out]`` (the released checkpoints, written
    before transformers 5)."""
    return _nested(mapping.DECODER + (
        mapping.layer_map("mlp.router.weight", "mlp.gate.weight"),
        mapping.layer_map("mlp.experts.linear_fc1_gate.weight", "mlp.experts.gate_up_proj", stacked=True,
                          split=(0, 2), transpose=transposed),
        mapping.layer_map("mlp.experts.linear_fc1.weight", "mlp.experts.gate_up_proj", stacked=True, split=(1, 2),
                          transpose=transposed),
        mapping.layer_map("mlp.experts.linear_fc2.weight", "mlp.experts.down_proj", stacked=True,
                          transpose=transposed),
    )) + VISION


QWEN3_VL_MOE = _moe_table(transposed=False)


def qwen3_vl_moe_weights(cfg: dict[str, Any]) -> tuple[mapping.WeightMap, ...]:
    """The MoE table for config.json ``cfg``: files written by transformers before 5 (``transformers_version``
    4.x: the hub's releases) hold the experts transposed; transformers 5 writes and reads ``[out, in]``."""
    version = str(cfg.get("transformers_version") or "5")
    return _moe_table(transposed=version.split(".")[0].isdigit() and int(version.split(".")[0]) < 5)

QWEN3_VL_FAMILY = Family("qwen3_vl", "Qwen3VLForConditionalGeneration", "qwen3_vl", QWEN3_VL,
                         qwen3_vl_provider, qwen3_vl_hf, Qwen3VLModelProvider)
QWEN3_VL_MOE_FAMILY = Family("qwen3_vl_moe", "Qwen3VLMoeForConditionalGeneration", "qwen3_vl_moe", QWEN3_VL_MOE,
                             qwen3_vl_moe_provider, qwen3_vl_moe_hf, Qwen3VLMoEModelProvider,
                             weights_for=qwen3_vl_moe_weights)


def qwen35_vl_provider(cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json dict -> ``Qwen35VLModelProvider`` keyword arguments (Qwen3.5's gated DeltaNet hybrid)."""
    return _provider(cfg, qwen35_provider, deepstack=False)


def qwen35_vl_hf(p: Any) -> dict[str, Any]:
    """``Qwen35VLModelProvider`` -> config.json dict."""
    return _hf(p, qwen35_hf, "qwen3_5", deepstack=False)


def qwen35_vl_weights(cfg: dict[str, Any]) -> tuple[mapping.WeightMap, ...]:
    """The language model's table (Qwen3.5's, for its layer pattern) under ``model.language_model``, and the
    encoder's."""
    return _nested(qwen35_weights(text_config(cfg, "Qwen3_5ForCausalLM", "qwen3_5_text"))) + VISION


QWEN35_VL_FAMILY = Family("qwen3_5_vl", "Qwen3_5ForConditionalGeneration", "qwen3_5", QWEN3_VL, qwen35_vl_provider,
                          qwen35_vl_hf, Qwen35VLModelProvider, weights_for=qwen35_vl_weights,
                          text_tower=QWEN35_VL_TEXT)


def qwen35_vl_moe_provider(cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json dict -> ``Qwen35VLMoEModelProvider`` keyword arguments (experts on every layer)."""
    return _provider(cfg, qwen35_moe_provider, deepstack=False)


def qwen35_vl_moe_hf(p: Any) -> dict[str, Any]:
    """``Qwen35VLMoEModelProvider`` -> config.json dict."""
    return _hf(p, qwen35_moe_hf, "qwen3_5_moe", deepstack=False)


def qwen35_vl_moe_weights(cfg: dict[str, Any]) -> tuple[mapping.WeightMap, ...]:
    """Qwen3.5-MoE's table under ``model.language_model``, and the encoder's."""
    return _nested(qwen35_moe_weights(text_config(cfg, "Qwen3_5MoeForCausalLM", "qwen3_5_moe_text"))) + VISION


QWEN35_VL_MOE_FAMILY = Family("qwen3_5_moe_vl", "Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe", QWEN3_VL,
                              qwen35_vl_moe_provider, qwen35_vl_moe_hf, Qwen35VLMoEModelProvider,
                              weights_for=qwen35_vl_moe_weights, text_tower=QWEN35_MOE_VL_TEXT)
