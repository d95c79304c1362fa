"""DeepSeek-V3 (``DeepseekV3ForCausalLM``: DeepSeek-V3/R1, Kimi K2, Moonlight) config translation: multi-latent
attention (``longspan.models.mla``) with DeepSeek's interleaved rotary channels, RoPE or YaRN, and DeepSeek's
mixture of experts.

What maps where (``WEIGHTS``):

- every layer ``model.layers.{i}.self_attn.*``: multi-latent attention (``ATTENTION``);
- the first ``first_k_dense_replace`` layers ``mlp.{gate,up,down}_proj``: the dense MLP of ``intermediate_size``;
- the later layers the DeepSeek-style MoE shared with GLM-4.5 (``conversion.expert_bias_moe``: its config keys and
  names): the router ``mlp.gate.weight`` with its aux-loss-free routing bias
  ``mlp.gate.e_score_correction_bias`` (longspan's float32 ``router.expert_bias`` buffer), the routed experts
  ``mlp.experts.{e}.*`` stacked into one slab per projection, and ``mlp.shared_experts.*`` as one MLP of
  ``n_shared_experts * moe_intermediate_size``;
- the multi-token-prediction layers after the decoder (``num_nextn_predict_layers``, depth k stored as
  ``model.layers.{num_hidden_layers + k}.*``): ``enorm`` / ``hnorm`` / ``eh_proj`` / ``shared_head.norm`` are
  ``mtp.layers.{k}.enorm`` / ``hnorm`` / ``eh_proj`` / ``final_layernorm``, the rest is the depth's
  ``transformer_layer`` under the decoder layers' names (``mapping.with_mtp``, shared with GLM-4.5). The depth's
  ``embed_tokens`` / ``shared_head.head`` repeat the shared embedding and output head, which longspan's depths use
  (megatron-core's): the import checks each copy equals them bit for bit (a one-line ``CheckpointError`` names a
  copy that differs), the export writes them from the shared tensors. ``mtp_num_layers`` comes from
  ``num_nextn_predict_layers`` (None for 0) as in Megatron Bridge, with its default ``mtp_loss_scaling_factor``
  (0.1, Bridge's DeepSeek-V3 recipe); ``longspan.conversion.mtp_layers`` says what happens when the files hold
  fewer layers or the model asks for fewer or more.
"""

from __future__ import annotations

from typing import Any

from longspan.conversion.config_fields import (
    HF_ACTIVATIONS,
    dtype_fields,
    hf_activation,
    required,
    rope_fields,
    vocab_divisor,
)
from longspan.conversion.expert_bias_moe import EXPERT_BIAS_MOE_MLP, expert_bias_moe_fields, expert_bias_moe_hf_fields
from longspan.conversion.families import Family
from longspan.conversion.mapping import DECODER_EMBEDDINGS, DECODER_MLP, layer_map
from longspan.conversion.mtp_layers import HF_MTP_KEY, declared_depths, mtp_weights_for
from longspan.core.errors import NotSupportedError
from longspan.models.mla import yarn_mscale

# DeepSeek-V3 (dense layers): multi-latent attention (longspan.models.mla). Without query compression HF has
# q_proj, with it q_a_proj / q_a_layernorm / q_b_proj; kv_a_proj_with_mqa is [latent | shared rotary key] as
# longspan's linear_kv_down_proj; kv_b_proj is per head [key without RoPE | value] as linear_kv_up_proj.
ATTENTION = (
    layer_map("input_layernorm.weight", "input_layernorm.weight"),
    layer_map("self_attention.linear_q_proj.weight", "self_attn.q_proj.weight"),
    layer_map("self_attention.linear_q_down_proj.weight", "self_attn.q_a_proj.weight"),
    layer_map("self_attention.q_layernorm.weight", "self_attn.q_a_layernorm.weight"),
    layer_map("self_attention.linear_q_up_proj.weight", "self_attn.q_b_proj.weight"),
    layer_map("self_attention.linear_kv_down_proj.weight", "self_attn.kv_a_proj_with_mqa.weight"),
    layer_map("self_attention.kv_layernorm.weight", "self_attn.kv_a_layernorm.weight"),
    layer_map("self_attention.linear_kv_up_proj.weight", "self_attn.kv_b_proj.weight"),
    layer_map("self_attention.linear_proj.weight", "self_attn.o_proj.weight"),
    layer_map("pre_mlp_layernorm.weight", "post_attention_layernorm.weight"),
)

# MLA on every layer, the standard dense MLP on the first first_k_dense_replace layers, the shared MoE after.
WEIGHTS = DECODER_EMBEDDINGS + ATTENTION + DECODER_MLP + EXPERT_BIAS_MOE_MLP

# transformers builds DeepSeek-V3's latent norms (q_a_layernorm, kv_a_layernorm) with this epsilon whatever
# rms_norm_eps says (Moonlight's is 1e-5); longspan's (as megatron-core's) use layernorm_epsilon like every other
# norm unless mla_latent_layernorm_epsilon gives them their own, which the import sets when the two differ.
HF_LATENT_NORM_EPS = 1e-6

# transformers' DeepseekV3Config defaults for the MoE keys a config.json may leave out (GLM's differ).
HF_MOE_DEFAULTS = dict(n_routed_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048, n_shared_experts=1,
                       first_k_dense_replace=3, n_group=8, topk_group=4, norm_topk_prob=True,
                       routed_scaling_factor=2.5)


def _check_deepseek_config(cfg: dict[str, Any]) -> None:
    act = cfg.get("hidden_act", "silu")
    if act not in HF_ACTIVATIONS:
        raise NotSupportedError(f"config.json hidden_act={act!r} is not supported: use one of {', '.join(HF_ACTIVATIONS)}")
    if cfg.get("attention_bias"):
        raise NotSupportedError("config.json attention_bias=true is not supported for DeepSeek-V3: set it to false")
    if cfg.get("rope_interleave", True) is False:
        raise NotSupportedError(
            "config.json rope_interleave=false is not supported: longspan's multi-latent attention reads the rotary "
            "channels as interleaved pairs (DeepSeek's and megatron-core's layout)"
        )


def mla_rope_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """RoPE / YaRN provider fields of a DeepSeek config: YaRN's factor and mscales as MLA's own fields."""
    out = rope_fields(cfg)
    kind = out.get("position_embedding_type")
    if any(key in out for key in ("rope_scaling", "seq_len_interpolation_factor", "rope_dynamic_factor",
                                  "rope_longrope_short_factor", "rotary_percent")):
        raise NotSupportedError(
            "config.json rope_parameters: multi-latent attention models convert with rope_type 'default' or 'yarn' "
            "and the whole qk_rope_head_dim rotating"
        )
    if kind != "yarn":
        return out
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    factor = out.pop("yarn_rotary_scaling_factor")
    out["rotary_scaling_factor"] = factor
    if "yarn_mscale" in out:  # both mscales set: transformers' cos/sin factor is their ratio, as MLA's
        out["mscale"] = out.pop("yarn_mscale")
        out["mscale_all_dim"] = out.pop("yarn_mscale_all_dim")
        return out
    all_dim = float(params.get("mscale_all_dim") or 0.0)
    out.update(mscale=1.0, mscale_all_dim=all_dim)  # the softmax scale reads mscale_all_dim alone
    if all_dim and "rope_attention_factor" not in out:
        out["rope_attention_factor"] = yarn_mscale(factor, 1.0)  # transformers' cos/sin factor without mscale
    return out


def _with_moe_defaults(cfg: dict[str, Any]) -> dict[str, Any]:
    return {**HF_MOE_DEFAULTS, **{k: v for k, v in cfg.items() if v is not None}}


def deepseek_v3_provider(cfg: dict[str, Any]) -> dict[str, Any]:
    """GPTModelProvider fields of a ``DeepseekV3ForCausalLM`` config.json (dense or with MoE layers)."""
    _check_deepseek_config(cfg)
    heads = required(cfg, "num_attention_heads")
    vocab = required(cfg, "vocab_size")
    eps = float(cfg.get("rms_norm_eps", HF_LATENT_NORM_EPS))
    out: dict[str, Any] = dict(
        num_layers=required(cfg, "num_hidden_layers"),
        hidden_size=required(cfg, "hidden_size"),
        ffn_hidden_size=required(cfg, "intermediate_size"),
        num_attention_heads=heads,
        multi_latent_attention=True,
        q_lora_rank=cfg.get("q_lora_rank"),
        kv_lora_rank=required(cfg, "kv_lora_rank"),
        qk_head_dim=required(cfg, "qk_nope_head_dim"),
        qk_pos_emb_head_dim=required(cfg, "qk_rope_head_dim"),
        v_head_dim=required(cfg, "v_head_dim"),
        qk_layernorm=True,  # the latent norms q_a_layernorm / kv_a_layernorm
        seq_length=cfg.get("max_position_embeddings", 4096),
        vocab_size=vocab,
        make_vocab_size_divisible_by=vocab_divisor(vocab),
        normalization="RMSNorm",
        layernorm_epsilon=eps,
        mla_latent_layernorm_epsilon=None if eps == HF_LATENT_NORM_EPS else HF_LATENT_NORM_EPS,
        gated_linear_unit=True,
        activation_func=HF_ACTIVATIONS[cfg.get("hidden_act", "silu")],
        add_bias_linear=False,
        share_embeddings_and_output_weights=bool(cfg.get("tie_word_embeddings", False)),
        attention_dropout=float(cfg.get("attention_dropout", 0.0)),
        hidden_dropout=0.0,
        init_method_std=float(cfg.get("initializer_range", 0.02)),
        mtp_num_layers=declared_depths(cfg) or None,
    )
    out.update(mla_rope_fields(cfg))
    out.update(dtype_fields(cfg))
    moe_cfg = _with_moe_defaults(cfg)
    if moe_cfg["n_routed_experts"] and int(moe_cfg["first_k_dense_replace"]) < out["num_layers"]:
        out.update(expert_bias_moe_fields(moe_cfg, out["num_layers"]))
    return out


def mla_rope_hf(p: Any) -> dict[str, Any]:
    """config.json's RoPE / YaRN keys of a multi-latent attention provider ``p`` (``mla_rope_fields`` reversed)."""
    params: dict[str, Any] = {"rope_theta": float(p.rotary_base), "rope_type": "default"}
    if p.position_embedding_type == "yarn":
        factor = float(p.rotary_scaling_factor)
        params.update(rope_type="yarn", factor=factor,
                      original_max_position_embeddings=int(p.yarn_original_max_position_embeddings),
                      beta_fast=float(p.yarn_beta_fast or 32.0), beta_slow=float(p.yarn_beta_slow or 1.0),
                      mscale=float(p.mscale), mscale_all_dim=float(p.mscale_all_dim))
        if not p.yarn_correction_range_round_to_int:
            params["truncate"] = False
        if p.rope_attention_factor is not None:
            params["attention_factor"] = float(p.rope_attention_factor)
        elif not p.mscale_all_dim and p.mscale != 1.0:  # transformers ignores mscale without mscale_all_dim
            params["attention_factor"] = yarn_mscale(factor, float(p.mscale))
    elif p.mscale_all_dim:
        raise NotSupportedError(
            f"mscale_all_dim={p.mscale_all_dim!r} with position_embedding_type='rope' has no HF equivalent "
            "(transformers scales the softmax by the mscale only under YaRN): use 'yarn' or mscale_all_dim=0"
        )
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    return {"rope_parameters": params, "rope_theta": params["rope_theta"],
            "rope_scaling": scaling if params["rope_type"] != "default" else None}


def check_mla_exportable(p: Any, family: str) -> str:
    """The HF activation name of a multi-latent attention provider that ``family``'s transformers class (DeepSeek-V3's
    attention) can hold; a one-line NotSupportedError naming what it cannot."""
    act = hf_activation(p)
    if not p.multi_latent_attention:
        raise NotSupportedError(f"{family} export needs multi_latent_attention=True")
    if act is None or not p.gated_linear_unit or p.normalization != "RMSNorm" or not p.qk_layernorm:
        raise NotSupportedError(
            f"this model has no {family} HF equivalent (needs RMSNorm, the latent norms (qk_layernorm) and a "
            "gated silu/gelu MLP)"
        )
    latent = p.layernorm_epsilon if p.mla_latent_layernorm_epsilon is None else p.mla_latent_layernorm_epsilon
    if latent != HF_LATENT_NORM_EPS:
        raise NotSupportedError(
            f"model.mla_latent_layernorm_epsilon={p.mla_latent_layernorm_epsilon!r} (layernorm_epsilon="
            f"{p.layernorm_epsilon!r}): {family} in transformers normalizes the latents with eps "
            f"{HF_LATENT_NORM_EPS} whatever rms_norm_eps says; export needs that latent epsilon"
        )
    if p.add_bias_linear:
        raise NotSupportedError(f"{family} export supports bias-free models only (add_bias_linear=False)")
    return act


def deepseek_v3_hf(p: Any) -> dict[str, Any]:
    """config.json of a multi-latent attention provider as a ``DeepseekV3ForCausalLM`` (dense or MoE)."""
    act = check_mla_exportable(p, "DeepSeek-V3")
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
        first_k_dense_replace=p.num_layers,
        max_position_embeddings=p.seq_length,
        rms_norm_eps=p.layernorm_epsilon,
        hidden_act=act,
        tie_word_embeddings=bool(p.share_embeddings_and_output_weights),
        attention_dropout=float(p.attention_dropout),
        initializer_range=float(p.init_method_std),
        attention_bias=False,
        rope_interleave=True,
    )
    out[HF_MTP_KEY] = int(p.mtp_num_layers or 0)
    out.update(mla_rope_hf(p))
    if p.num_moe_experts:
        out.update(expert_bias_moe_hf_fields(p))
    return out


DEEPSEEK_V3 = Family("deepseek_v3", "DeepseekV3ForCausalLM", "deepseek_v3", WEIGHTS, deepseek_v3_provider,
                     deepseek_v3_hf, weights_for=mtp_weights_for(WEIGHTS), mtp_layers=True)
