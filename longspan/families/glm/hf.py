"""Config translation of GLM-4.5 / GLM-4.6 (``Glm4MoeForCausalLM``, transformers' ``glm4_moe``).

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
"""

from __future__ import annotations

from typing import Any

from longspan.conversion.decoder_fields import decoder_hf, decoder_provider, provider_view
from longspan.conversion.expert_bias_moe import EXPERT_BIAS_MOE_MLP, expert_bias_moe_fields, expert_bias_moe_hf_fields
from longspan.conversion.families import Family
from longspan.conversion.mapping import DECODER
from longspan.conversion.mtp_layers import HF_MTP_KEY, declared_depths, mtp_weights_for

# Llama's attention (q/k/v biases, optional per-head QK-norm) and MLP names, then the shared MoE's.
WEIGHTS = DECODER + EXPERT_BIAS_MOE_MLP

# transformers' Glm4MoeConfig default when config.json has no partial_rotary_factor.
GLM_PARTIAL_ROTARY_DEFAULT = 0.5
# Megatron Bridge's GLM-4.5 bridge weighs the multi-token-prediction loss so.
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
