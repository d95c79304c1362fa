"""Gemma 4's vision-language model (``Gemma4ForConditionalGeneration`` with a ``vision_config``): config
translation and weight table.

config.json nests the language model under ``text_config`` (translated as ``Gemma4ForCausalLM``) and the vision
encoder under ``vision_config``; the image tokens are ``image_token_id`` / ``boi_token_id`` / ``eoi_token_id``.
Weights: the language model under ``model.language_model.``, the encoder under ``model.vision_tower.`` and the
projector under ``model.embed_vision.``. A config.json without ``vision_config`` is the text model alone: it
imports as Gemma 4's text tower (``GEMMA4_VL_TEXT``, exported as ``Gemma4ForCausalLM``). An ``audio_config`` is
refused in one line (audio is not supported yet).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import longspan.conversion.mapping as mapping
from longspan.conversion.families import Family
from longspan.core.errors import NotSupportedError
from longspan.families.gemma4.hf import GEMMA4, GEMMA4_VL_TEXT, gemma4_hf
from longspan.families.gemma4_vl.provider import Gemma4VLModelProvider
from longspan.families.qwen35.hf import text_config

ARCHITECTURE = "Gemma4ForConditionalGeneration"

#: vision_config keys the encoder reads (the others, e.g. transformers' bookkeeping, are not kept)
VISION_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "hidden_activation", "rms_norm_eps", "attention_bias",
                 "attention_dropout", "rope_parameters", "pooling_kernel_size", "patch_size",
                 "position_embedding_size", "use_clipped_linears", "standardize")


def gemma4_vlm_provider(cfg: dict[str, Any]) -> dict[str, Any]:
    """Gemma4VLModelProvider fields of a Gemma4ForConditionalGeneration config.json: the language model from
    its ``text_config``, the encoder from ``vision_config``, the image tokens."""
    if cfg.get("audio_config"):
        raise NotSupportedError("config.json audio_config: Gemma 4's audio encoder is not supported yet (longspan "
                                "converts Gemma4ForConditionalGeneration with images; drop audio_config)")
    text = text_config(cfg, GEMMA4.architecture, GEMMA4.model_type)
    if text.get("use_bidirectional_attention"):
        raise NotSupportedError(f"config.json text_config.use_bidirectional_attention="
                                f"{text['use_bidirectional_attention']!r} is not supported yet: longspan's Gemma 4 "
                                "with images attends causally (null)")
    out = GEMMA4.to_provider(text)
    vision = cfg["vision_config"]
    out.update(
        vision_config={k: vision[k] for k in VISION_FIELDS if k in vision},
        image_token_id=int(cfg.get("image_token_id", 258_880)),
        vision_start_token_id=int(cfg.get("boi_token_id", 255_999)),
        vision_end_token_id=int(cfg.get("eoi_token_id", 258_882)),
        pad_token_id=int(text.get("pad_token_id", 0) or 0),
    )
    for key in ("bos_token_id", "eos_token_id"):
        value = cfg.get(key, text.get(key))
        if value is not None:
            out[key] = value
    return out


def gemma4_vlm_hf(p: Any) -> dict[str, Any]:
    """A Gemma4ForConditionalGeneration config.json body for a Gemma4VLModelProvider."""
    if not isinstance(p, Gemma4VLModelProvider) or not p.vision_config:
        raise NotSupportedError("this model has no vision encoder: export it as Gemma4ForCausalLM")
    text = dict(gemma4_hf(p), model_type="gemma4_text", pad_token_id=p.pad_token_id, bos_token_id=p.bos_token_id,
                eos_token_id=p.eos_token_id)
    vision = dict(p.vision_config, model_type="gemma4_vision")
    return dict(text_config=text, vision_config=vision, audio_config=None, image_token_id=p.image_token_id,
                boi_token_id=p.vision_start_token_id, eoi_token_id=p.vision_end_token_id,
                tie_word_embeddings=text["tie_word_embeddings"], initializer_range=text["initializer_range"])


def _same(name: str, **kw: Any) -> mapping.WeightMap:
    """An encoder or projector tensor: longspan keeps HF's module names under ``model.``."""
    return mapping.WeightMap(name, f"model.{name}", **kw)


_LINEARS = tuple(f"self_attn.{m}" for m in ("q_proj", "k_proj", "v_proj", "o_proj")) + tuple(
    f"mlp.{m}" for m in ("gate_proj", "up_proj", "down_proj"))
_LAYER = "vision_tower.encoder.layers.{i}."


def vision_weights(vision: dict[str, Any]) -> tuple[mapping.WeightMap, ...]:
    """The encoder's and projector's tensors (the clamp bounds and standardization buffers when it has them)."""
    table = [_same(f"{_LAYER}{m}.linear.weight") for m in _LINEARS]
    table += [_same(f"{_LAYER}{n}.weight") for n in (
        "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm",
        "self_attn.q_norm", "self_attn.k_norm")]
    if vision.get("use_clipped_linears"):
        table += [_same(f"{_LAYER}{m}.{b}", buffer=True) for m in _LINEARS
                  for b in ("input_min", "input_max", "output_min", "output_max")]
    table += [_same("vision_tower.patch_embedder.input_proj.weight"),
              _same("vision_tower.patch_embedder.position_embedding_table"),
              _same("embed_vision.embedding_projection.weight")]
    if vision.get("standardize"):
        table += [_same("vision_tower.std_bias", buffer=True), _same("vision_tower.std_scale", buffer=True)]
    return tuple(table)


def gemma4_vlm_weights(cfg: dict[str, Any]) -> tuple[mapping.WeightMap, ...]:
    """The language model's table (Gemma 4 text's under ``language_model.`` / ``model.language_model.``) and
    the encoder's and projector's."""
    text = GEMMA4.weights_for(text_config(cfg, GEMMA4.architecture, GEMMA4.model_type))
    text = mapping.with_prefix(text, "model.", "model.language_model.")
    return mapping.with_ours_prefix(text, "language_model.") + vision_weights(cfg.get("vision_config") or {})


@dataclass(frozen=True)
class Gemma4VLFamily(Family):
    """``Gemma4ForConditionalGeneration``: with a ``vision_config`` the whole model, without one its text tower."""

    def for_config(self, cfg: dict[str, Any]) -> Family:
        """The text tower's family for a config.json without a vision encoder, else this one's table for it."""
        if not cfg.get("vision_config"):
            return GEMMA4_VL_TEXT.for_config(cfg)
        return super().for_config(cfg)


GEMMA4_VLM_FAMILY = Gemma4VLFamily(
    "gemma4_vlm", ARCHITECTURE, "gemma4", (), gemma4_vlm_provider, gemma4_vlm_hf,
    provider_class=Gemma4VLModelProvider, weights_for=gemma4_vlm_weights, tie_word_embeddings_default=True)
