"""Config translations of GLM-4.5 / GLM-4.6 (``Glm4MoeForCausalLM``) and GLM-4.7-Flash (``Glm4MoeLiteForCausalLM``).

## GLM-4.5 / GLM-4.6 (transformers' ``glm4_moe``)

A Llama-style decoder with:

- partial RoPE: the first ``partial_rotary_factor`` of each head's channels rotate in the rotate_half layout
  (longspan's ``rotary_percent``); transformers defaults the factor to 0.5 when config.json leaves it out;
- biases on q/k/v only (``attention_bias``) and an optional per-head QK-norm before RoPE (``use_qk_norm``);
- DeepSeek-V3 routing: sigmoid scores, the choice made on ``scores + e_score_correction_bias`` (longspan's
  float32 ``router.expert_bias`` buffer, ``moe_router_enable_expert_bias``), group-limited top-k
  (``n_group`` / ``topk_group``; a group scores the sum of its top two), the chosen unbiased scores normalized
  (``norm_topk_prob``) and scaled by ``routed_scaling_factor``; router logits in float32;
- ``n_shared_experts`` shared experts as one MLP of ``n_shared_experts * moe_intermediate_size``;
- the first ``first_k_dense_replace`` layers dense (``intermediate_size``), the rest MoE.

``conversion.expert_bias_moe`` translates the MoE keys and names GLM-4.5 shares with DeepSeek-V3.

The multi-token-prediction layers GLM checkpoints ship after the decoder (``num_nextn_predict_layers``, stored
as ``model.layers.{num_hidden_layers + k}``) use DeepSeek-V3's names (``mapping.with_mtp``, one table for both).
As Megatron Bridge's GLM-4.5 bridge, the import sets ``mtp_num_layers`` from ``num_nextn_predict_layers`` (None
for 0) and ``mtp_loss_scaling_factor`` to 0.3.

## GLM-4.7-Flash (transformers' ``glm4_moe_lite``)

DeepSeek-V3's multi-latent attention (``longspan.models.mla``, DeepSeek's interleaved rotary channels, RoPE or
YaRN, the same HF names: ``families.deepseek.hf.ATTENTION``) on GLM's mixture of experts
(``conversion.expert_bias_moe``: sigmoid routing with the ``e_score_correction_bias`` expert bias, group-limited
top-k, shared experts). What differs from DeepSeek-V3:

- which layers are MoE: ``mlp_layer_types``, one ``"dense"`` / ``"sparse"`` per layer, becomes longspan's list
  form of ``moe_layer_freq`` (1 = MoE) and back, any pattern. transformers ignores ``first_k_dense_replace`` here
  and defaults the list to one dense layer then MoE layers; a config.json without the list whose
  ``first_k_dense_replace`` says otherwise is rejected (transformers would build other layers than its files);
- the norm epsilons: ``rms_norm_eps`` (1e-5 in GLM-4.7-Flash) for the layer and final norms, while transformers
  builds the latent norms ``q_a_layernorm`` / ``kv_a_layernorm`` with 1e-6 whatever it says: the import sets
  ``mla_latent_layernorm_epsilon`` to 1e-6 when ``rms_norm_eps`` differs;
- transformers' defaults for the MoE keys a config.json leaves out (``Glm4MoeLiteConfig``'s, below);
- multi-token prediction: the layers after the decoder (``num_nextn_predict_layers``, GLM-4.7-Flash ships one as
  ``model.layers.47``, which transformers skips) use DeepSeek-V3's names (``mapping.with_mtp``); as Megatron
  Bridge's GLM-4.7-Flash bridge, ``mtp_num_layers`` comes from ``num_nextn_predict_layers`` (None for 0) with
  ``mtp_loss_scaling_factor`` 0.3.
"""

from __future__ import annotations

from typing import Any

from longspan.conversion.config_fields import HF_ACTIVATIONS, dtype_fields, required, vocab_divisor
from longspan.conversion.decoder_fields import decoder_hf, decoder_provider, provider_view
from longspan.conversion.expert_bias_moe import EXPERT_BIAS_MOE_MLP, expert_bias_moe_fields, expert_bias_moe_hf_fields
from longspan.conversion.families import Family
from longspan.conversion.mapping import DECODER
from longspan.conversion.mtp_layers import HF_MTP_KEY, declared_depths, mtp_weights_for
from longspan.core.errors import ConfigError, NotSupportedError
from longspan.families.deepseek.hf import HF_LATENT_NORM_EPS, check_mla_exportable, mla_rope_fields, mla_rope_hf
from longspan.families.deepseek.hf import WEIGHTS as MLA_MOE_WEIGHTS
from longspan.models.layer_pattern import moe_layer_flags

# Llama's attention (q/k/v biases, optional per-head QK-norm) and MLP names, then the shared MoE's.
WEIGHTS = DECODER + EXPERT_BIAS_MOE_MLP

# transformers' Glm4MoeConfig default when config.json has no partial_rotary_factor.
GLM_PARTIAL_ROTARY_DEFAULT = 0.5
# Megatron Bridge's GLM-4.5 and GLM-4.7-Flash bridges weigh the multi-token-prediction loss so.
GLM_MTP_LOSS_SCALING_FACTOR = 0.3


def _partial_rotary_factor(cfg: dict[str, Any]) -> float:
    params = cfg.get("rope_parameters") or {}
    for value in (params.get("partial_rotary_factor"), cfg.get("partial_rotary_factor")):
        if value is not None:
            return float(value)
    return GLM_PARTIAL_ROTARY_DEFAULT


def glm4_moe_provider(cfg: dict[str, Any]) -> dict[str, Any]:
    """Provider keyword arguments of a GLM-4.5 config.json."""
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope_cfg = dict(cfg, rope_parameters=dict(rope, partial_rotary_factor=_partial_rotary_factor(cfg)))
    out = decoder_provider(dict(rope_cfg, attention_bias=False), eps_default=1e-5, family="GLM-4.5")
    out.update(add_qkv_bias=bool(cfg.get("attention_bias", False)), qk_layernorm=bool(cfg.get("use_qk_norm", False)))
    out.update(expert_bias_moe_fields(cfg, out["num_layers"]))
    out.update(mtp_num_layers=declared_depths(cfg) or None, mtp_loss_scaling_factor=GLM_MTP_LOSS_SCALING_FACTOR)
    return out


def glm4_moe_hf(p: Any) -> dict[str, Any]:
    """A GLM-4.5 config.json body for provider ``p``."""
    out = decoder_hf(provider_view(p, add_qkv_bias=False), family="GLM-4.5")
    out.pop("mlp_bias")
    out.pop("partial_rotary_factor", None)
    out.update(
        rope_parameters=dict(out["rope_parameters"], partial_rotary_factor=float(p.rotary_percent)),
        attention_bias=bool(p.add_qkv_bias),
        use_qk_norm=bool(p.qk_layernorm),
    )
    out[HF_MTP_KEY] = int(p.mtp_num_layers or 0)
    out.update(expert_bias_moe_hf_fields(p))
    return out


GLM4_MOE = Family("glm4_moe", "Glm4MoeForCausalLM", "glm4_moe", WEIGHTS, glm4_moe_provider, glm4_moe_hf,
                  weights_for=mtp_weights_for(WEIGHTS), mtp_layers=True)


LITE = "GLM-4.7-Flash"

# transformers' Glm4MoeLiteConfig defaults for the keys a config.json may leave out.
HF_LITE_DEFAULTS = dict(n_routed_experts=64, num_experts_per_tok=4, moe_intermediate_size=1536, n_shared_experts=1,
                        n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.8, rms_norm_eps=1e-5)

# mlp_layer_types' spellings and the moe_layer_freq flag each is.
MLP_LAYER_TYPES = {"dense": 0, "sparse": 1}


def _check_lite_config(cfg: dict[str, Any]) -> None:
    act = cfg.get("hidden_act", "silu")
    if act not in HF_ACTIVATIONS:
        raise NotSupportedError(
            f"config.json hidden_act={act!r} is not supported: use one of {', '.join(HF_ACTIVATIONS)}")
    if cfg.get("attention_bias"):
        raise NotSupportedError(f"config.json attention_bias=true is not supported for {LITE}: longspan's "
                                "multi-latent attention projections are bias-free (set it to false)")
    if cfg.get("rope_interleave", True) is False:
        raise NotSupportedError(
            "config.json rope_interleave=false is not supported: longspan's multi-latent attention reads the rotary "
            "channels as interleaved pairs (DeepSeek's and megatron-core's layout)"
        )
    heads, kv_heads = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
    if kv_heads is not None and kv_heads != heads:
        raise NotSupportedError(f"config.json num_key_value_heads={kv_heads} is not supported for {LITE}: "
                                f"multi-latent attention gives every head its own keys (use {heads})")
    params = cfg.get("rope_parameters") or {}
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise NotSupportedError(f"config.json partial_rotary_factor={partial!r} is not supported for {LITE}: the "
                                "whole qk_rope_head_dim rotates (use 1.0)")


def mlp_layer_flags(cfg: dict[str, Any], num_layers: int) -> list[int]:
    """``moe_layer_freq`` (list form, 1 = MoE) of config.json ``cfg``'s ``mlp_layer_types``, or of transformers'
    default (the first layer dense, the rest MoE) when it has none."""
    types = cfg.get("mlp_layer_types")
    if types is None:
        dense = cfg.get("first_k_dense_replace")
        if dense is not None and dense != 1:
            raise ConfigError(
                f"config.json first_k_dense_replace={dense} without mlp_layer_types: transformers' {LITE} ignores "
                "it and makes layer 0 dense, the rest MoE; say which layers are MoE in mlp_layer_types"
            )
        return [0] + [1] * (num_layers - 1)
    if not isinstance(types, list) or len(types) != num_layers or any(t not in MLP_LAYER_TYPES for t in types):
        raise ConfigError(f"config.json mlp_layer_types={types!r} must list {num_layers} entries (num_hidden_layers), "
                          f"each one of {', '.join(repr(t) for t in MLP_LAYER_TYPES)}")
    return [MLP_LAYER_TYPES[t] for t in types]


def glm4_moe_lite_provider(cfg: dict[str, Any]) -> dict[str, Any]:
    """GPTModelProvider fields of a ``Glm4MoeLiteForCausalLM`` config.json."""
    _check_lite_config(cfg)
    cfg = {**HF_LITE_DEFAULTS, **{k: v for k, v in cfg.items() if v is not None}}
    num_layers = required(cfg, "num_hidden_layers")
    vocab = required(cfg, "vocab_size")
    eps = float(cfg["rms_norm_eps"])
    out: dict[str, Any] = dict(
        num_layers=num_layers,
        hidden_size=required(cfg, "hidden_size"),
        ffn_hidden_size=required(cfg, "intermediate_size"),
        num_attention_heads=required(cfg, "num_attention_heads"),
        multi_latent_attention=True,
        q_lora_rank=cfg.get("q_lora_rank"),
        kv_lora_rank=required(cfg, "kv_lora_rank"),
        qk_head_dim=required(cfg, "qk_nope_head_dim"),
        qk_pos_emb_head_dim=required(cfg, "qk_rope_head_dim"),
        v_head_dim=required(cfg, "v_head_dim"),
        qk_layernorm=True,  # the latent norms q_a_layernorm / kv_a_layernorm
        mla_latent_layernorm_epsilon=None if eps == HF_LATENT_NORM_EPS else HF_LATENT_NORM_EPS,
        seq_length=cfg.get("max_position_embeddings", 4096),
        vocab_size=vocab,
        make_vocab_size_divisible_by=vocab_divisor(vocab),
        normalization="RMSNorm",
        layernorm_epsilon=eps,
        gated_linear_unit=True,
        activation_func=HF_ACTIVATIONS[cfg.get("hidden_act", "silu")],
        add_bias_linear=False,
        share_embeddings_and_output_weights=bool(cfg.get("tie_word_embeddings", False)),
        attention_dropout=float(cfg.get("attention_dropout", 0.0)),
        hidden_dropout=0.0,
        init_method_std=float(cfg.get("initializer_range", 0.02)),
        mtp_num_layers=declared_depths(cfg) or None,
        mtp_loss_scaling_factor=GLM_MTP_LOSS_SCALING_FACTOR,
    )
    out.update(mla_rope_fields(cfg))
    out.update(dtype_fields(cfg))
    flags = mlp_layer_flags(cfg, num_layers)
    if any(flags):
        out.update(expert_bias_moe_fields(dict(cfg, first_k_dense_replace=0), num_layers), moe_layer_freq=flags)
    return out


def _moe_hf(p: Any) -> dict[str, Any]:
    """The MoE keys of config.json: ``mlp_layer_types`` from ``moe_layer_freq``, the routing keys of GLM's MoE."""
    flags = moe_layer_flags(p.moe_layer_freq, p.num_layers) if p.num_moe_experts else [False] * p.num_layers
    out: dict[str, Any] = {"mlp_layer_types": ["sparse" if f else "dense" for f in flags]}
    if p.num_moe_experts:
        # every layer MoE for the shared translation's prefix check; mlp_layer_types above says which are
        out.update(expert_bias_moe_hf_fields(provider_view(p, moe_layer_freq=1)))
        out.pop("first_k_dense_replace")
    return out


def glm4_moe_lite_hf(p: Any) -> dict[str, Any]:
    """config.json of a multi-latent attention provider as a ``Glm4MoeLiteForCausalLM``."""
    act = check_mla_exportable(p, LITE)
    out = dict(
        vocab_size=p.vocab_size,
        hidden_size=p.hidden_size,
        intermediate_size=p.ffn_hidden_size,
        num_hidden_layers=p.num_layers,
        num_attention_heads=p.num_attention_heads,
        num_key_value_heads=p.num_attention_heads,
        q_lora_rank=p.q_lora_rank,
        kv_lora_rank=p.kv_lora_rank,
        qk_nope_head_dim=p.qk_head_dim,
        qk_rope_head_dim=p.qk_pos_emb_head_dim,
        v_head_dim=p.v_head_dim,
        max_position_embeddings=p.seq_length,
        rms_norm_eps=p.layernorm_epsilon,
        hidden_act=act,
        tie_word_embeddings=bool(p.share_embeddings_and_output_weights),
        attention_dropout=float(p.attention_dropout),
        initializer_range=float(p.init_method_std),
        attention_bias=False,
        rope_interleave=True,
        rope_parameters=mla_rope_hf(p)["rope_parameters"],
    )
    out[HF_MTP_KEY] = int(p.mtp_num_layers or 0)
    out.update(_moe_hf(p))
    return out


GLM4_MOE_LITE = Family("glm4_moe_lite", "Glm4MoeLiteForCausalLM", "glm4_moe_lite", MLA_MOE_WEIGHTS,
                       glm4_moe_lite_provider, glm4_moe_lite_hf, weights_for=mtp_weights_for(MLA_MOE_WEIGHTS),
                       mtp_layers=True)
