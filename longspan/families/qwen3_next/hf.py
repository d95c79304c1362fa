"""Qwen3-Next (``Qwen3NextForCausalLM``): config.json and weights, and the pieces Qwen3.5 / Qwen3.6 share.

A hybrid decoder: ``layer_types`` marks each layer ``linear_attention`` (a gated DeltaNet mixer, longspan's
``experimental_attention_variant="gated_delta_net"``) or ``full_attention`` (attention with an output gate,
``attention_output_gate``); Megatron's ``linear_attention_freq`` holds the same pattern as a 0/1 list (1 = linear).
Every RMSNorm outside the mixer stores ``gamma - 1`` (``x * (1 + w)``: ``layernorm_zero_centered_gamma``),
the DeltaNet's gated output norm stores gamma itself; RoPE covers ``partial_rotary_factor`` of each head
(transformers' default 0.25 when config.json leaves it out). The MLPs are mixtures of experts (softmax top-k,
renormalised with ``norm_topk_prob``) with a shared expert scaled by ``sigmoid(x @ shared_expert_gate)``,
or dense on ``mlp_only_layers``.

Weights: Qwen3-Next fuses a DeltaNet's input projections per key head, ``in_proj_qkvz`` rows
``[q | k | v | z]`` and ``in_proj_ba`` rows ``[b | a]`` for each key head in turn (the value heads of a key head
together), and its conv1d channels ``[q | k | v]``; a gated attention's ``q_proj`` holds ``[query | gate]``
per head. longspan keeps each part as its own parameter (so tensor parallel splits them by heads), the tables
cut the fused tensors on import and fuse them on export (``WeightMap.split_groups``).
"""

from __future__ import annotations

from typing import Any

from longspan.conversion.config_fields import required
from longspan.conversion.decoder_fields import decoder_hf, decoder_provider
from longspan.conversion.families import Family
from longspan.conversion.hf_fields import HFField, export_fields, import_fields
from longspan.conversion.mapping import DECODER_EMBEDDINGS, WeightMap
from longspan.core.errors import NotSupportedError
from longspan.models.layer_pattern import (
    layer_types_from_linear_attention,
    linear_attention_layer_flags,
    linear_attention_pattern_from_layer_types,
)

LINEAR = "linear_attention"
FULL = "full_attention"

#: the gated DeltaNet mixer's config.json keys (HF's and Megatron's names are the same), with transformers'
#: defaults
LINEAR_FIELDS: tuple[HFField, ...] = (
    HFField("linear_conv_kernel_dim", "linear_conv_kernel_dim", default=4, to_ours=int),
    HFField("linear_key_head_dim", "linear_key_head_dim", default=128, to_ours=int),
    HFField("linear_value_head_dim", "linear_value_head_dim", default=128, to_ours=int),
    HFField("linear_num_key_heads", "linear_num_key_heads", default=16, to_ours=int),
    HFField("linear_num_value_heads", "linear_num_value_heads", default=32, to_ours=int),
)

#: the mixture of experts (Qwen3-Next's and Qwen3.5-MoE's keys)
MOE_FIELDS: tuple[HFField, ...] = (
    HFField("num_experts", "num_moe_experts", to_ours=int),
    HFField("num_experts_per_tok", "moe_router_topk", default=10, to_ours=int),
    HFField("moe_intermediate_size", "moe_ffn_hidden_size", default=512, to_ours=int),
    HFField("shared_expert_intermediate_size", "moe_shared_expert_intermediate_size", default=512, to_ours=int),
    HFField("router_aux_loss_coef", "moe_aux_loss_coeff", default=0.001, to_ours=float,
            from_provider=lambda p: float(_first(p.moe_aux_loss_coeff))),
)


def _first(value: Any) -> Any:
    return value[0] if isinstance(value, (list, tuple)) else value


# ----------------------------------------------------------------------------------------------- config

def layer_types(cfg: dict[str, Any]) -> list[str]:
    """config.json's ``layer_types`` (transformers' default: every ``full_attention_interval``-th layer full)."""
    layers = int(required(cfg, "num_hidden_layers"))
    kinds = cfg.get("layer_types")
    if kinds is None:
        interval = int(cfg.get("full_attention_interval") or 4)
        kinds = [LINEAR if (i + 1) % interval else FULL for i in range(layers)]
    if len(kinds) != layers:
        raise NotSupportedError(f"config.json layer_types has {len(kinds)} entries for num_hidden_layers={layers}")
    linear_attention_pattern_from_layer_types(kinds)  # one line naming an unknown kind
    return list(kinds)


def linear_flags(p: Any) -> list[bool]:
    """Provider ``p``'s gated DeltaNet layers (``linear_attention_freq``; none when unset)."""
    if p.linear_attention_freq is None:
        return [False] * int(p.num_layers)
    return linear_attention_layer_flags(p.linear_attention_freq, int(p.num_layers))


def _with_partial_rotary(cfg: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` with transformers' partial_rotary_factor default (0.25) spelled out where RoPE is read."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if "partial_rotary_factor" not in params and cfg.get("partial_rotary_factor") is None:
        params["partial_rotary_factor"] = 0.25
        params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
        return dict(cfg, rope_parameters=params)
    return cfg


def hybrid_provider(cfg: dict[str, Any], family: str) -> dict[str, Any]:
    """GPTModelProvider keyword arguments of the hybrid decoder (no MoE fields): the standard decoder's, the
    layer pattern, the DeltaNet mixer, the attention output gate, per-head QK-norm and the (1 + w) norms."""
    kinds = layer_types(cfg)
    out = decoder_provider(_with_partial_rotary(cfg), family=family)
    out.update(import_fields(LINEAR_FIELDS, cfg))
    out.update(
        experimental_attention_variant="gated_delta_net",
        linear_attention_freq=linear_attention_pattern_from_layer_types(kinds),
        attention_output_gate=True,
        qk_layernorm=True,
        layernorm_zero_centered_gamma=True,
    )
    return out


def check_hybrid(p: Any, family: str) -> None:
    """One-line NotSupportedError for a provider that is not this hybrid decoder."""
    ok = (p.experimental_attention_variant == "gated_delta_net" and p.attention_output_gate and p.qk_layernorm
          and not p.qk_layernorm_across_heads and p.layernorm_zero_centered_gamma and not p.add_bias_linear
          and not p.add_qkv_bias and p.layernorm_before_sublayers and not p.layernorm_after_sublayers)
    if not ok:
        raise NotSupportedError(
            f"this model has no {family} equivalent (needs experimental_attention_variant='gated_delta_net', "
            "attention_output_gate, per-head qk_layernorm, layernorm_zero_centered_gamma, pre-norm layers and no "
            "biases)"
        )


def hybrid_hf(p: Any, family: str) -> dict[str, Any]:
    """config.json entries of the hybrid decoder (no MoE keys)."""
    check_hybrid(p, family)
    out = decoder_hf(p, family=family)
    out.pop("mlp_bias")
    out.update(export_fields(LINEAR_FIELDS, p))
    out["layer_types"] = layer_types_from_linear_attention(linear_flags(p))
    return out


def moe_flags(p: Any) -> list[int]:
    """Provider ``p``'s MoE layers as a 0/1 list (every layer when ``moe_layer_freq`` is 1)."""
    freq, layers = p.moe_layer_freq, int(p.num_layers)
    if isinstance(freq, int):
        return [int(i % freq == 0) for i in range(layers)]
    return [int(x) for x in freq]


def qwen3_next_provider(cfg: dict[str, Any]) -> dict[str, Any]:
    """Provider keyword arguments of a Qwen3-Next config.json."""
    out = hybrid_provider(cfg, family="Qwen3-Next")
    flags = qwen3_next_moe_layers(cfg)
    if not any(flags):
        return out
    out.update(import_fields(MOE_FIELDS, dict(cfg, num_experts=cfg.get("num_experts", 512))))
    out.update(
        moe_layer_freq=1 if all(flags) else flags,
        moe_shared_expert_gate=True,
        moe_router_pre_softmax=not bool(cfg.get("norm_topk_prob", True)),
        moe_router_load_balancing_type="aux_loss",
    )
    return out


def check_moe(p: Any, family: str) -> None:
    """One-line NotSupportedError for MoE settings these architectures cannot hold."""
    if not p.num_moe_experts:
        return
    ok = (p.moe_router_score_function == "softmax" and p.moe_shared_expert_gate
          and p.moe_shared_expert_intermediate_size and not p.moe_router_topk_scaling_factor
          and not p.moe_router_enable_expert_bias)
    if not ok:
        raise NotSupportedError(f"this model's experts have no {family} equivalent (needs softmax top-k routing "
                                "without scaling or expert bias and a shared expert with its sigmoid gate)")


def qwen3_next_hf(p: Any) -> dict[str, Any]:
    """A Qwen3-Next config.json body for provider ``p``."""
    check_moe(p, "Qwen3-Next")
    out = hybrid_hf(p, "Qwen3-Next")
    if not p.num_moe_experts:
        return dict(out, num_experts=0, mlp_only_layers=[], decoder_sparse_step=1)
    flags = moe_flags(p)
    out.update(export_fields(MOE_FIELDS, p))
    out.update(norm_topk_prob=not p.moe_router_pre_softmax, decoder_sparse_step=1,
               mlp_only_layers=[i for i, f in enumerate(flags) if not f])
    return out


# ----------------------------------------------------------------------------------------------- weights

def layer_entry(i: int, ours: str, hf: str, **kw: Any) -> WeightMap:
    """Layer ``i``'s entry: ``decoder.layers.{i}.<ours>`` <-> ``model.layers.{i}.<hf>``."""
    return WeightMap(f"decoder.layers.{i}.{ours}", f"model.layers.{i}.{hf}", **kw)


def mixer_sizes(cfg: dict[str, Any]) -> tuple[int, int, int, int]:
    """(key heads, value heads, key head dim, value head dim) of the DeltaNet mixer, with transformers' defaults."""
    fields = import_fields(LINEAR_FIELDS, cfg)
    return (fields["linear_num_key_heads"], fields["linear_num_value_heads"], fields["linear_key_head_dim"],
            fields["linear_value_head_dim"])


def conv_entries(i: int, cfg: dict[str, Any]) -> tuple[WeightMap, ...]:
    """The depthwise conv's channels ``[q | k | v]`` (HF's one conv1d) as longspan's three segments."""
    kh, vh, kd, vd = mixer_sizes(cfg)
    units = (kh * kd, kh * kd, vh * vd)
    return tuple(layer_entry(i, f"self_attention.conv_{part}.weight", "linear_attn.conv1d.weight", split=(j, 3),
                        split_units=units) for j, part in enumerate("qkv"))


def mixer_common(i: int) -> tuple[WeightMap, ...]:
    """The DeltaNet tensors Qwen3-Next and Qwen3.5 store alike."""
    return (
        layer_entry(i, "self_attention.dt_bias", "linear_attn.dt_bias"),
        layer_entry(i, "self_attention.A_log", "linear_attn.A_log"),
        layer_entry(i, "self_attention.norm.weight", "linear_attn.norm.weight"),
        layer_entry(i, "self_attention.linear_proj.weight", "linear_attn.out_proj.weight"),
    )


def fused_mixer(i: int, cfg: dict[str, Any]) -> tuple[WeightMap, ...]:
    """Qwen3-Next's DeltaNet: ``in_proj_qkvz`` and ``in_proj_ba`` interleaved per key head."""
    kh, vh, kd, vd = mixer_sizes(cfg)
    per = vh // kh  # value heads of one key head
    qkvz = (kd, kd, per * vd, per * vd)
    table = [layer_entry(i, f"self_attention.linear_{part}.weight", "linear_attn.in_proj_qkvz.weight", split=(j, 4),
                    split_units=qkvz, split_groups=kh) for j, part in enumerate("qkvz")]
    table += [layer_entry(i, f"self_attention.linear_{part}.weight", "linear_attn.in_proj_ba.weight", split=(j, 2),
                     split_groups=kh) for j, part in enumerate("ba")]
    return (*table, *conv_entries(i, cfg), *mixer_common(i))


def gated_attention(i: int, cfg: dict[str, Any]) -> tuple[WeightMap, ...]:
    """A full-attention layer: ``q_proj`` holds ``[query | gate]`` per head; per-head QK-norm."""
    heads = int(required(cfg, "num_attention_heads"))
    return (
        layer_entry(i, "self_attention.linear_q.weight", "self_attn.q_proj.weight", split=(0, 2), split_groups=heads),
        layer_entry(i, "self_attention.linear_gate.weight", "self_attn.q_proj.weight", split=(1, 2),
                    split_groups=heads),
        layer_entry(i, "self_attention.linear_k.weight", "self_attn.k_proj.weight"),
        layer_entry(i, "self_attention.linear_v.weight", "self_attn.v_proj.weight"),
        layer_entry(i, "self_attention.linear_proj.weight", "self_attn.o_proj.weight"),
        layer_entry(i, "self_attention.q_layernorm.weight", "self_attn.q_norm.weight"),
        layer_entry(i, "self_attention.k_layernorm.weight", "self_attn.k_norm.weight"),
    )


def dense_mlp(i: int) -> tuple[WeightMap, ...]:
    return (
        layer_entry(i, "mlp.linear_fc1_gate.weight", "mlp.gate_proj.weight"),
        layer_entry(i, "mlp.linear_fc1.weight", "mlp.up_proj.weight"),
        layer_entry(i, "mlp.linear_fc2.weight", "mlp.down_proj.weight"),
    )


def moe_mlp(i: int) -> tuple[WeightMap, ...]:
    """Routed experts (one HF module per expert) and the shared expert with its sigmoid gate."""
    return (
        layer_entry(i, "mlp.router.weight", "mlp.gate.weight"),
        layer_entry(i, "mlp.experts.linear_fc1_gate.weight", "mlp.experts.{e}.gate_proj.weight", per_expert=True),
        layer_entry(i, "mlp.experts.linear_fc1.weight", "mlp.experts.{e}.up_proj.weight", per_expert=True),
        layer_entry(i, "mlp.experts.linear_fc2.weight", "mlp.experts.{e}.down_proj.weight", per_expert=True),
        layer_entry(i, "mlp.shared_experts.linear_fc1_gate.weight", "mlp.shared_expert.gate_proj.weight"),
        layer_entry(i, "mlp.shared_experts.linear_fc1.weight", "mlp.shared_expert.up_proj.weight"),
        layer_entry(i, "mlp.shared_experts.linear_fc2.weight", "mlp.shared_expert.down_proj.weight"),
        layer_entry(i, "mlp.shared_experts.gate_weight", "mlp.shared_expert_gate.weight"),
    )


def hybrid_weights(cfg: dict[str, Any], mixer: Any, moe_layers: list[int]) -> tuple[WeightMap, ...]:
    """The whole table: embeddings, then per layer its norms, its mixer (``mixer(i, cfg)`` for linear layers,
    gated attention for full ones) and its MLP (MoE on ``moe_layers``' 1s)."""
    table = list(DECODER_EMBEDDINGS)
    for i, kind in enumerate(layer_types(cfg)):
        table += [layer_entry(i, "input_layernorm.weight", "input_layernorm.weight"),
                  layer_entry(i, "pre_mlp_layernorm.weight", "post_attention_layernorm.weight")]
        table += mixer(i, cfg) if kind == LINEAR else gated_attention(i, cfg)
        table += moe_mlp(i) if moe_layers[i] else dense_mlp(i)
    return tuple(table)


def qwen3_next_moe_layers(cfg: dict[str, Any]) -> list[int]:
    """config.json's MoE layers as a 0/1 list (``decoder_sparse_step``, ``mlp_only_layers``; none without experts)."""
    layers = int(required(cfg, "num_hidden_layers"))
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = set(cfg.get("mlp_only_layers") or [])
    experts = int(cfg.get("num_experts", 512))
    return [int(experts > 0 and i not in dense and (i + 1) % step == 0) for i in range(layers)]


def qwen3_next_weights(cfg: dict[str, Any]) -> tuple[WeightMap, ...]:
    """Qwen3-Next's weight table for config.json dict ``cfg``."""
    return hybrid_weights(cfg, fused_mixer, qwen3_next_moe_layers(cfg))


QWEN3_NEXT = Family("qwen3_next", "Qwen3NextForCausalLM", "qwen3_next", DECODER_EMBEDDINGS, qwen3_next_provider,
                    qwen3_next_hf, weights_for=qwen3_next_weights)
