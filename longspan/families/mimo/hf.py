"""MiMo-V2-Flash (``MiMoV2FlashForCausalLM``, transformers' ``mimo_v2_flash``) as config.json and weights.

A Llama-style decoder (RMSNorm, SwiGLU, no linear biases) with, as transformers builds it:

- sliding-window layers (``layer_types``; transformers' default: layer 0 and every sixth layer full, the rest
  sliding) with ``2 * num_key_value_heads`` KV heads and a learned sink logit per head
  (``self_attn.attention_sink_bias`` in the files): ``window_num_query_groups`` and ``window_softmax_type``;
  full-attention layers with ``num_key_value_heads`` and no sinks;
- queries and keys ``head_dim`` wide, values ``v_head_dim`` wide, the values multiplied by
  ``attention_value_scale`` (null: 1) before attention; the softmax scale is ``head_dim ** -0.5``;
- RoPE per layer kind (``rope_parameters.full_attention`` / ``.sliding_attention``: longspan's ``[local, global]``
  ``rotary_base``) over the first ``int(head_dim * partial_rotary_factor)`` channels (one factor for both kinds);
- DeepSeek-V3's sigmoid routing without shared experts (``conversion.expert_bias_moe``: the
  ``e_score_correction_bias`` expert bias, group-limited top-k) on the layers ``mlp_layer_types`` marks
  ``"sparse"`` (longspan's list form of ``moe_layer_freq``; transformers' default: layer 0 dense, the rest MoE).

Multi-token prediction: released checkpoints ship MTP blocks as ``model.mtp.layers.*``, but transformers'
class has no module for them and skips them on load, and its config.json no count of them; the import reads what
transformers reads (the ``model.mtp.*`` tensors are left out) and the export refuses ``mtp_num_layers``.
"""

from __future__ import annotations

from typing import Any

from longspan.conversion.config_fields import _whole, hf_activation, window_fields, window_hf
from longspan.conversion.decoder_fields import activation_func, decoder_shape, decoder_shape_hf, provider_view
from longspan.conversion.expert_bias_moe import EXPERT_BIAS_MOE_MLP, expert_bias_moe_fields, expert_bias_moe_hf_fields
from longspan.conversion.families import Family
from longspan.conversion.mapping import DECODER_ATTENTION, DECODER_EMBEDDINGS, DECODER_MLP, layer_map
from longspan.core.errors import ConfigError, NotSupportedError
from longspan.families.mimo.provider import MiMoV2FlashModelProvider
from longspan.models.layer_pattern import moe_layer_flags

NAME = "MiMo-V2-Flash"

WEIGHTS = DECODER_EMBEDDINGS + DECODER_ATTENTION + DECODER_MLP + EXPERT_BIAS_MOE_MLP + (
    layer_map("self_attention.softmax_offset", "self_attn.attention_sink_bias"),
)

# transformers' MiMoV2FlashConfig defaults for the keys a config.json may leave out (or write as null).
HF_DEFAULTS = dict(head_dim=192, v_head_dim=128, sliding_window=129, rms_norm_eps=1e-5, n_routed_experts=256,
                   num_experts_per_tok=8, moe_intermediate_size=2048, n_group=1, topk_group=1, norm_topk_prob=True,
                   routed_scaling_factor=1.0, max_position_embeddings=131072, hidden_act="silu")
HF_VALUE_SCALE_DEFAULT = 0.707
HF_PARTIAL_ROTARY_DEFAULT = 0.334
HF_ROPE_THETAS = {"full_attention": 5_000_000.0, "sliding_attention": 10_000.0}
# transformers gives the sliding-window layers twice the full-attention layers' KV heads.
WINDOW_KV_FACTOR = 2
_FULL, _SLIDING = "full_attention", "sliding_attention"
MLP_LAYER_TYPES = {"dense": 0, "sparse": 1}


def _layer_types(cfg: dict[str, Any], n: int) -> list[str]:
    types = cfg.get("layer_types")
    if types is None:
        return [_FULL if (i == 0 or not (i + 1) % 6) else _SLIDING for i in range(n)]
    if not isinstance(types, list) or len(types) != n or any(t not in (_FULL, _SLIDING) for t in types):
        raise ConfigError(f"config.json layer_types={types!r} must list {n} entries (num_hidden_layers), each "
                          f"'{_FULL}' or '{_SLIDING}'")
    return types


def _mlp_flags(cfg: dict[str, Any], n: int) -> list[int]:
    types = cfg.get("mlp_layer_types")
    if types is None:
        return [0] + [1] * (n - 1)
    if not isinstance(types, list) or len(types) != n or any(t not in MLP_LAYER_TYPES for t in types):
        raise ConfigError(f"config.json mlp_layer_types={types!r} must list {n} entries (num_hidden_layers), "
                          f"each one of {', '.join(repr(t) for t in MLP_LAYER_TYPES)}")
    return [MLP_LAYER_TYPES[t] for t in types]


def _rope_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """``rotary_base`` ``[sliding, full]`` and ``rotary_percent`` of the per-layer-kind ``rope_parameters``."""
    params = cfg.get("rope_parameters") or {kind: {"rope_type": "default", "rope_theta": theta}
                                             for kind, theta in HF_ROPE_THETAS.items()}
    thetas, partials = {}, set()
    for kind in (_SLIDING, _FULL):
        kind_params = params.get(kind) or {}
        rope_type = kind_params.get("rope_type", "default")
        if rope_type != "default":
            raise NotSupportedError(f"config.json rope_parameters.{kind}.rope_type={rope_type!r} is not supported "
                                    f"for {NAME}: use 'default'")
        thetas[kind] = _whole(kind_params.get("rope_theta", HF_ROPE_THETAS[kind]))
        partials.add(float(kind_params.get("partial_rotary_factor", HF_PARTIAL_ROTARY_DEFAULT)))
    if len(partials) > 1:
        raise NotSupportedError(f"config.json rope_parameters' partial_rotary_factor differ by layer kind "
                                f"({sorted(partials)}): longspan rotates one fraction of every head")
    # rope_scaling_factor: with a [local, global] base it divides the global frequencies (Gemma 3's); none here
    return dict(position_embedding_type="rope", rotary_base=[thetas[_SLIDING], thetas[_FULL]],
                rope_scaling_factor=1.0, rotary_percent=partials.pop())


def mimo_provider(cfg: dict[str, Any]) -> dict[str, Any]:
    """MiMoV2FlashModelProvider fields of a ``MiMoV2FlashForCausalLM`` config.json."""
    value_scale = cfg.get("attention_value_scale", HF_VALUE_SCALE_DEFAULT)
    window = cfg.get("sliding_window")
    if cfg.get("sliding_window_size") is not None:  # transformers: the SGLang reference's count plus the query
        window = int(cfg["sliding_window_size"]) + 1
    cfg = {**HF_DEFAULTS, **{k: v for k, v in cfg.items() if v is not None}}
    out = decoder_shape(cfg, eps_default=1e-5)
    n, heads, groups = out["num_layers"], out["num_attention_heads"], out["num_query_groups"]
    window_groups = WINDOW_KV_FACTOR * groups
    if heads % window_groups:
        raise ConfigError(f"config.json num_key_value_heads={groups}: {NAME}'s sliding-window layers have "
                          f"{WINDOW_KV_FACTOR} * num_key_value_heads = {window_groups} KV heads, which must divide "
                          f"num_attention_heads={heads}")
    types = _layer_types(cfg, n)
    out.update(
        activation_func=activation_func(cfg),
        share_embeddings_and_output_weights=bool(cfg.get("tie_word_embeddings", False)),
        v_head_dim=int(cfg["v_head_dim"]),
        window_num_query_groups=window_groups,
        softmax_type="vanilla",
        window_softmax_type="learnable",
        attention_value_scale=None if value_scale is None else float(value_scale),
    )
    out.update(_rope_fields(cfg))
    out.update(window_fields(HF_DEFAULTS["sliding_window"] if window is None else window, types, n))
    flags = _mlp_flags(cfg, n)
    if any(flags):
        out.update(expert_bias_moe_fields(dict(cfg, first_k_dense_replace=0, n_shared_experts=0), n),
                   moe_layer_freq=flags)
    return out


def _check_exportable(p: Any) -> None:
    act = hf_activation(p)
    if act != "silu" or not p.gated_linear_unit or p.normalization != "RMSNorm" or p.add_bias_linear \
            or p.add_qkv_bias or p.position_embedding_type != "rope":
        raise NotSupportedError(f"this model has no {NAME} HF equivalent (needs RMSNorm, RoPE, a SwiGLU MLP and no "
                                "linear biases)")
    if p.mtp_num_layers:
        raise NotSupportedError(f"model.mtp_num_layers={p.mtp_num_layers} has no {NAME} HF equivalent: transformers' "
                                "MiMoV2FlashForCausalLM has no multi-token-prediction layers (use None)")
    groups = p.num_query_groups or p.num_attention_heads
    window_groups = getattr(p, "window_num_query_groups", None) or groups
    if window_groups != WINDOW_KV_FACTOR * groups:
        raise NotSupportedError(f"model.window_num_query_groups={window_groups} has no {NAME} HF equivalent: "
                                f"transformers gives the sliding-window layers {WINDOW_KV_FACTOR} * num_query_groups "
                                f"= {WINDOW_KV_FACTOR * groups} KV heads")
    window_softmax = getattr(p, "window_softmax_type", None) or p.softmax_type
    if (p.softmax_type, window_softmax) != ("vanilla", "learnable"):
        raise NotSupportedError(f"model.softmax_type={p.softmax_type!r} / window_softmax_type={window_softmax!r} "
                                f"have no {NAME} HF equivalent: learned sinks on the sliding-window layers only "
                                "('vanilla' / 'learnable')")
    if not isinstance(p.rotary_base, (list, tuple)) or float(p.rope_scaling_factor) != 1.0:
        raise NotSupportedError(f"model.rotary_base={p.rotary_base!r} with rope_scaling_factor="
                                f"{p.rope_scaling_factor!r} has no {NAME} HF equivalent: use a [sliding-window base, "
                                "full-attention base] pair and 1.0")


def _moe_hf(p: Any) -> dict[str, Any]:
    flags = moe_layer_flags(p.moe_layer_freq, p.num_layers) if p.num_moe_experts else [False] * p.num_layers
    out: dict[str, Any] = {"mlp_layer_types": ["sparse" if f else "dense" for f in flags]}
    if p.num_moe_experts:
        moe = expert_bias_moe_hf_fields(provider_view(p, moe_layer_freq=1))
        if moe.pop("n_shared_experts"):
            raise NotSupportedError(f"model.moe_shared_expert_intermediate_size="
                                    f"{p.moe_shared_expert_intermediate_size} has no {NAME} HF equivalent: its MoE "
                                    "has no shared experts (use None)")
        moe.pop("first_k_dense_replace")
        out.update(moe)
    return out


def mimo_hf(p: Any) -> dict[str, Any]:
    """config.json of a MiMoV2FlashModelProvider as a ``MiMoV2FlashForCausalLM``."""
    _check_exportable(p)
    out = decoder_shape_hf(p)
    local, full = (float(b) for b in p.rotary_base)
    partial = float(p.rotary_percent)
    window, layer_types = window_hf(p)
    scale = p.attention_value_scale
    out.update(
        hidden_act="silu",
        v_head_dim=int(p.v_head_dim or out["head_dim"]),
        attention_value_scale=None if scale is None else float(scale),
        layer_types=layer_types,
        rope_parameters={_FULL: {"partial_rotary_factor": partial, "rope_theta": full, "rope_type": "default"},
                         _SLIDING: {"partial_rotary_factor": partial, "rope_theta": local, "rope_type": "default"}},
    )
    if window is not None:
        out["sliding_window"] = window
    out.update(_moe_hf(p))
    return out


MIMO_V2_FLASH = Family("mimo_v2_flash", "MiMoV2FlashForCausalLM", "mimo_v2_flash", WEIGHTS, mimo_provider, mimo_hf,
                       provider_class=MiMoV2FlashModelProvider)
