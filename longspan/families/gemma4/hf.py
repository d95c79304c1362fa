"""Gemma 4's text model (``Gemma4ForCausalLM``) and its vision-language model (``Gemma4ForConditionalGeneration``)
as config.json and weights.

Plain RMSNorm ``x * w`` (not Gemma 2/3's ``1 + w``) before and after attention and the MLP, embeddings scaled
by sqrt(hidden), GeGLU with tanh GeLU, softmax scale 1 with per-head QK-norm, tied embeddings, sliding-window
layers between full-attention ones (``layer_types``, ``sliding_window``; Gemma 2/3's translation). The
full-attention layers' head width and KV heads come from ``per_layer_config`` (what transformers writes) or
``global_head_dim`` / ``num_global_key_value_heads`` (published files); their RoPE is proportional
(``rope_parameters.full_attention``).

With images, config.json nests the text model under ``text_config`` and the vision encoder under
``vision_config``; the image tokens are ``image_token_id`` / ``boi_token_id`` / ``eoi_token_id``. Weights: the
text model under ``model.language_model.``, the encoder under ``model.vision_tower.`` and the projector under
``model.embed_vision.``. A config.json without ``vision_config`` is the text model alone: it imports as the
text tower (``GEMMA4_VL_TEXT``, exported as ``Gemma4ForCausalLM``). An ``audio_config`` is refused in one line.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from longspan.conversion.config_fields import _whole, hf_activation, required
from longspan.conversion.decoder_fields import activation_func, decoder_shape, decoder_shape_hf
from longspan.conversion.families import Family
from longspan.conversion.mapping import (
    DECODER_EMBEDDINGS,
    DECODER_MLP,
    DECODER_QKVO,
    POST_SUBLAYER_NORMS,
    WeightMap,
    layer_map,
    with_ours_prefix,
    with_prefix,
)
from longspan.core.errors import NotSupportedError
from longspan.families.gemma.hf import _sliding_window_fields, _sliding_window_hf
from longspan.families.gemma4.provider import Gemma4ModelProvider
from longspan.families.gemma4.vl_provider import Gemma4VLModelProvider
from longspan.families.qwen35.hf import _tower as text_tower  # the text tower of a vision-language model

GEMMA4_WEIGHTS = DECODER_EMBEDDINGS + DECODER_QKVO + POST_SUBLAYER_NORMS + DECODER_MLP[:3] + (
    layer_map("input_layernorm.weight", "input_layernorm.weight"),
    layer_map("pre_mlp_layernorm.weight", "pre_feedforward_layernorm.weight"),
    layer_map("layer_scalar", "layer_scalar", buffer=True),
    layer_map("per_layer_input_gate.weight", "per_layer_input_gate.weight"),
    layer_map("per_layer_projection.weight", "per_layer_projection.weight"),
    layer_map("post_per_layer_input_norm.weight", "post_per_layer_input_norm.weight"),
    WeightMap("embedding.per_layer_word_embeddings.weight", "model.embed_tokens_per_layer.weight"),
    WeightMap("embedding.per_layer_projection.weight", "model.per_layer_model_projection.weight"),
    WeightMap("embedding.per_layer_projection_norm.weight", "model.per_layer_projection_norm.weight"),
)

# With the MoE block the dense MLP and its pre-norm move into the layer's MoE module (its shared expert).
_DENSE_ONLY = {"decoder.layers.{i}.pre_mlp_layernorm.weight"} | {e.ours for e in DECODER_MLP}
GEMMA4_MOE_WEIGHTS = tuple(e for e in GEMMA4_WEIGHTS if e.ours not in _DENSE_ONLY) + (
    layer_map("mlp.shared_experts.linear_fc1_gate.weight", "mlp.gate_proj.weight"),
    layer_map("mlp.shared_experts.linear_fc1.weight", "mlp.up_proj.weight"),
    layer_map("mlp.shared_experts.linear_fc2.weight", "mlp.down_proj.weight"),
    layer_map("mlp.pre_shared_layernorm.weight", "pre_feedforward_layernorm.weight"),
    layer_map("mlp.post_shared_layernorm.weight", "post_feedforward_layernorm_1.weight"),
    layer_map("mlp.pre_experts_layernorm.weight", "pre_feedforward_layernorm_2.weight"),
    layer_map("mlp.post_experts_layernorm.weight", "post_feedforward_layernorm_2.weight"),
    layer_map("mlp.router.weight", "router.proj.weight"),
    layer_map("mlp.router.scale", "router.scale"),
    layer_map("mlp.router.per_expert_scale", "router.per_expert_scale"),
    # gate_up_proj [E, 2 * ffn, hidden]: the gate's rows, then the up projection's
    layer_map("mlp.experts.linear_fc1_gate.weight", "experts.gate_up_proj", stacked=True, split=(0, 2)),
    layer_map("mlp.experts.linear_fc1.weight", "experts.gate_up_proj", stacked=True, split=(1, 2)),
    layer_map("mlp.experts.linear_fc2.weight", "experts.down_proj", stacked=True),
)

_SLIDING, _FULL = "sliding_attention", "full_attention"


def _layer_types(cfg: dict[str, Any]) -> list[str]:
    """config.json's ``layer_types``, or transformers' default (five sliding layers to one full one) with the
    last layer full, as transformers forces it."""
    types = cfg.get("layer_types")
    if types is None:
        n = int(required(cfg, "num_hidden_layers"))
        types = [_SLIDING if (i + 1) % 6 else _FULL for i in range(n)]
    types = list(types)
    if types and types[-1] != _FULL:
        raise NotSupportedError(f"config.json layer_types ends with {types[-1]!r}: Gemma 4's last layer is "
                                "full_attention (transformers forces it)")
    return types


def _global_attention(cfg: dict[str, Any], types: list[str]) -> dict[str, Any]:
    """The full-attention layers' head width and KV heads (``per_layer_config``, one setting for all of them)."""
    per_layer = cfg.get("per_layer_config")
    if per_layer is None:
        groups = cfg.get("num_global_key_value_heads") if cfg.get("attention_k_eq_v") else None
        return dict(global_kv_channels=int(cfg.get("global_head_dim", 512)), num_global_query_groups=groups)
    overrides = {int(key): dict(value or {}) for key, value in per_layer.items()}  # keys zero-padded: "05"
    settings = {}
    for i, kind in enumerate(types):
        entry = overrides.get(i, {})
        if kind == _SLIDING and entry:
            raise NotSupportedError(f"config.json per_layer_config[{i}]={entry} overrides a sliding-window layer: "
                                    "longspan's Gemma 4 overrides the full-attention layers only")
        if kind == _FULL:
            settings[i] = (entry.get("head_dim"), entry.get("num_key_value_heads"))
    distinct = set(settings.values())
    unknown = {k for entry in overrides.values() for k in entry if k not in ("head_dim", "num_key_value_heads")}
    if len(distinct) > 1 or unknown:
        raise NotSupportedError(f"config.json per_layer_config={per_layer}: longspan's Gemma 4 takes one head_dim / "
                                "num_key_value_heads for every full-attention layer")
    head_dim, groups = distinct.pop() if distinct else (None, None)
    return dict(global_kv_channels=head_dim, num_global_query_groups=groups)


def _rope_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    params = cfg.get("rope_parameters") or {}
    local = dict(params.get(_SLIDING) or {"rope_type": "default", "rope_theta": 10_000.0})
    full = dict(params.get(_FULL) or {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                      "rope_theta": 1_000_000.0})
    if local.get("rope_type", "default") != "default":
        raise NotSupportedError(f"config.json rope_parameters.{_SLIDING}.rope_type={local['rope_type']!r} is not "
                                "supported: longspan implements 'default' for Gemma 4's sliding-window layers")
    kind = full.get("rope_type", "default")
    if kind not in ("default", "proportional") or float(full.get("factor", 1.0)) != 1.0:
        raise NotSupportedError(f"config.json rope_parameters.{_FULL}={full} is not supported: longspan implements "
                                "'proportional' (and 'default') without a factor for Gemma 4's full-attention layers")
    percent = float(full.get("partial_rotary_factor", 1.0)) if kind == "proportional" else 1.0
    return dict(position_embedding_type="rope", rope_scaling=False, rope_scaling_factor=1.0,
                rotary_base=[_whole(local.get("rope_theta", 10_000.0)), _whole(full.get("rope_theta", 1_000_000.0))],
                global_rotary_percent=percent)


def _per_layer_config(types: list[str], overrides: dict[str, Any]) -> dict[str, Any]:
    """transformers' ``per_layer_config``: the full-attention layers' overrides, keys zero-padded to the widest
    index written."""
    full = [i for i, kind in enumerate(types) if kind == _FULL]
    digits = len(str(max(full))) if full else 1
    return {str(i).zfill(digits): dict(overrides) for i in full}


def gemma4_provider(cfg: dict[str, Any]) -> dict[str, Any]:
    """Provider keyword arguments of a Gemma 4 text config.json."""
    if cfg.get("use_bidirectional_attention"):
        raise NotSupportedError(f"config.json use_bidirectional_attention={cfg['use_bidirectional_attention']!r} is "
                                "not supported: longspan's Gemma 4 is causal (null)")
    types = _layer_types(cfg)
    out = decoder_shape(dict(cfg, head_dim=cfg.get("head_dim", 256)), eps_default=1e-6)
    out.update(
        layernorm_zero_centered_gamma=False,
        layernorm_after_sublayers=True,
        apply_embedding_scaling=True,
        activation_func=activation_func(cfg, "hidden_activation", "gelu_pytorch_tanh"),
        share_embeddings_and_output_weights=bool(cfg.get("tie_word_embeddings", True)),
        softmax_scale=1.0,
        qk_layernorm=True,
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
        attention_k_eq_v=bool(cfg.get("attention_k_eq_v", False)),
        num_kv_shared_layers=int(cfg.get("num_kv_shared_layers", 0) or 0),
        use_double_wide_mlp=bool(cfg.get("use_double_wide_mlp", False)),
        per_layer_embed_dim=int(cfg.get("hidden_size_per_layer_input", 256) or 0) or None,
        per_layer_embed_vocab_size=int(cfg.get("vocab_size_per_layer_input", 262_144)),
    )
    out.update(_sliding_window_fields(dict(cfg, layer_types=types, sliding_window=cfg.get("sliding_window", 512))))
    out.update(_rope_fields(cfg))
    out.update(_global_attention(cfg, types))
    out.update(_moe_fields(cfg))
    return out


def _moe_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """The MoE block's provider fields (``enable_moe_block``): experts on every layer, softmax over the top-k
    (HF renormalizes its softmax over all experts to the top-k: the same weights), no auxiliary loss (HF has
    none)."""
    if not cfg.get("enable_moe_block"):
        return {}
    return dict(num_moe_experts=int(required(cfg, "num_experts")), moe_router_topk=int(required(cfg, "top_k_experts")),
                moe_ffn_hidden_size=int(required(cfg, "moe_intermediate_size")), moe_layer_freq=1,
                moe_router_score_function="softmax", moe_router_pre_softmax=False,
                moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0)


def _moe_hf(p: Any) -> dict[str, Any]:
    """config.json's MoE keys for provider ``p`` (one-line error for routing HF's block cannot express)."""
    if not p.num_moe_experts:
        return dict(enable_moe_block=False)
    ok = (p.moe_router_score_function == "softmax" and not p.moe_router_pre_softmax
          and not p.moe_router_topk_scaling_factor and not p.moe_router_enable_expert_bias
          and not p.moe_router_group_topk and p.add_bias_linear is False)
    if not ok:
        raise NotSupportedError("this model's routing has no Gemma 4 equivalent (needs softmax over the top-k "
                                "experts without scaling, expert bias or groups)")
    return dict(enable_moe_block=True, num_experts=int(p.num_moe_experts), top_k_experts=int(p.moe_router_topk),
                moe_intermediate_size=int(p.moe_ffn_hidden_size or p.ffn_hidden_size))


def gemma4_hf(p: Any) -> dict[str, Any]:
    """A Gemma 4 text config.json body for provider ``p``."""
    ok = (isinstance(p, Gemma4ModelProvider) and p.normalization == "RMSNorm"
          and not p.layernorm_zero_centered_gamma and p.layernorm_after_sublayers and p.apply_embedding_scaling
          and p.gated_linear_unit and not p.add_bias_linear and not p.add_qkv_bias and p.qk_layernorm
          and not p.qk_layernorm_across_heads and p.softmax_scale == 1.0 and hf_activation(p) is not None
          and isinstance(p.rotary_base, (list, tuple)))
    if not ok:
        raise NotSupportedError("this model has no Gemma 4 equivalent (needs a Gemma4ModelProvider with RMSNorm "
                                "before and after attention and the MLP, embedding scaling, per-head QK-norm, "
                                "softmax scale 1, a [local, global] rotary_base, a gated MLP and no biases)")
    out = decoder_shape_hf(p)
    local, full = (float(b) for b in p.rotary_base)
    full_rope: dict[str, Any] = {"rope_type": "proportional", "partial_rotary_factor": float(p.global_rotary_percent),
                                 "rope_theta": full}
    windows = _sliding_window_hf(p)
    per_layer: dict[str, Any] = {"head_dim": int(p.global_kv_channels or out["head_dim"])}
    if p.num_global_query_groups is not None:
        per_layer["num_key_value_heads"] = int(p.num_global_query_groups)
    out.update(
        hidden_activation={"gelu_new": "gelu_pytorch_tanh"}.get(hf_activation(p), hf_activation(p)),
        final_logit_softcapping=p.final_logit_softcapping,
        rope_parameters={_SLIDING: {"rope_type": "default", "rope_theta": local}, _FULL: full_rope},
        attention_k_eq_v=bool(p.attention_k_eq_v),
        num_kv_shared_layers=int(p.num_kv_shared_layers),
        use_double_wide_mlp=bool(p.use_double_wide_mlp),
        hidden_size_per_layer_input=int(p.per_layer_embed_dim or 0),
        vocab_size_per_layer_input=int(p.per_layer_embed_vocab_size or p.vocab_size),
        **_moe_hf(p),
        per_layer_config=_per_layer_config(windows["layer_types"], per_layer),
        **windows,
    )
    return out


GEMMA4 = Family("gemma4", "Gemma4ForCausalLM", "gemma4_text", GEMMA4_WEIGHTS, gemma4_provider, gemma4_hf,
                provider_class=Gemma4ModelProvider, tie_word_embeddings_default=True,
                weights_for=lambda cfg: GEMMA4_MOE_WEIGHTS if cfg.get("enable_moe_block") else GEMMA4_WEIGHTS)
# Gemma4ForConditionalGeneration's language model (``model.language_model.*``, fields under ``text_config``):
# imported as the causal LM, exported as one.
GEMMA4_VL_TEXT = replace(text_tower(GEMMA4, "Gemma4ForConditionalGeneration", "gemma4"),
                         provider_class=Gemma4ModelProvider, tie_word_embeddings_default=True)


# --------------------------------------------------------------------------------------------- with images

def _text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The Gemma4ForCausalLM config.json of a Gemma4ForConditionalGeneration one's ``text_config`` (with the top
    level's dtype and tied embeddings)."""
    text = dict(cfg.get("text_config") or {})
    if not text:
        raise NotSupportedError("config.json of Gemma4ForConditionalGeneration has no text_config to convert")
    for key in ("dtype", "torch_dtype", "tie_word_embeddings"):
        if cfg.get(key) is not None:
            text[key] = cfg[key]
    dtype = text.pop("torch_dtype", None)
    text.setdefault("dtype", dtype)
    return dict(text, architectures=[GEMMA4.architecture], model_type=GEMMA4.model_type)


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
    text = _text_config(cfg)
    mode = text.get("use_bidirectional_attention")
    if mode not in (None, "vision"):
        raise NotSupportedError(f"config.json text_config.use_bidirectional_attention={mode!r} is not supported: "
                                "longspan's Gemma 4 with images takes null (causal) or 'vision'")
    out = GEMMA4.to_provider(dict(text, use_bidirectional_attention=None))
    out["use_bidirectional_attention"] = mode
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
                eos_token_id=p.eos_token_id, use_bidirectional_attention=p.use_bidirectional_attention)
    vision = dict(p.vision_config, model_type="gemma4_vision")
    return dict(text_config=text, vision_config=vision, audio_config=None, image_token_id=p.image_token_id,
                boi_token_id=p.vision_start_token_id, eoi_token_id=p.vision_end_token_id,
                tie_word_embeddings=text["tie_word_embeddings"], initializer_range=text["initializer_range"])


def _same(name: str, **kw: Any) -> WeightMap:
    """An encoder or projector tensor: longspan keeps HF's module names under ``model.``."""
    return WeightMap(name, f"model.{name}", **kw)


_LINEARS = tuple(f"self_attn.{m}" for m in ("q_proj", "k_proj", "v_proj", "o_proj")) + tuple(
    f"mlp.{m}" for m in ("gate_proj", "up_proj", "down_proj"))
_LAYER = "vision_tower.encoder.layers.{i}."


def vision_weights(vision: dict[str, Any]) -> tuple[WeightMap, ...]:
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


def gemma4_vlm_weights(cfg: dict[str, Any]) -> tuple[WeightMap, ...]:
    """The language model's table (Gemma 4 text's under ``language_model.`` / ``model.language_model.``) and
    the encoder's and projector's."""
    text = GEMMA4.weights_for(_text_config(cfg))
    text = with_prefix(text, "model.", "model.language_model.")
    return with_ours_prefix(text, "language_model.") + vision_weights(cfg.get("vision_config") or {})


@dataclass(frozen=True)
class Gemma4VLFamily(Family):
    """``Gemma4ForConditionalGeneration``: with a ``vision_config`` the whole model, without one its text tower."""

    def for_config(self, cfg: dict[str, Any]) -> Family:
        """The text tower's family for a config.json without a vision encoder, else this one's table for it."""
        if not cfg.get("vision_config"):
            return GEMMA4_VL_TEXT.for_config(cfg)
        return super().for_config(cfg)


GEMMA4_VLM_FAMILY = Gemma4VLFamily(
    "gemma4_vlm", "Gemma4ForConditionalGeneration", "gemma4", (), gemma4_vlm_provider, gemma4_vlm_hf,
    provider_class=Gemma4VLModelProvider, weights_for=gemma4_vlm_weights, tie_word_embeddings_default=True,
    text_tower=GEMMA4_VL_TEXT)
