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

``deepseek_moe_fields`` / ``deepseek_moe_hf_fields`` translate the MoE keys GLM-4.5 shares with DeepSeek-V3's
config.json (the same router, experts and names: ``mapping.DEEPSEEK_MOE_MLP``).

The multi-token-prediction layers GLM checkpoints ship after the decoder (``num_nextn_predict_layers``, stored
as ``model.layers.{num_hidden_layers + k}``) use DeepSeek-V3's names (``mapping.with_mtp``, one table for both;
see ``deepseek_families``). As Megatron Bridge's GLM-4.5 bridge, the import sets ``mtp_num_layers`` from
``num_nextn_predict_layers`` (None for 0) and ``mtp_loss_scaling_factor`` to 0.3.
"""

from __future__ import annotations

from typing import Any

from longspan.conversion.config_fields import required
from longspan.conversion.decoder_fields import decoder_hf, decoder_provider
from longspan.conversion.mtp_layers import HF_MTP_KEY, declared_depths
from longspan.core.errors import NotSupportedError

# transformers' Glm4MoeConfig default when config.json has no partial_rotary_factor.
GLM_PARTIAL_ROTARY_DEFAULT = 0.5
# transformers' Glm4MoeTopkRouter scores each expert group by the sum of its top two scores.
GLM_GROUP_SCORE_TOPK = 2
# Megatron Bridge's GLM-4.5 bridge weighs the multi-token-prediction loss so.
GLM_MTP_LOSS_SCALING_FACTOR = 0.3


def _partial_rotary_factor(cfg: dict[str, Any]) -> float:
    params = cfg.get("rope_parameters") or {}
    for value in (params.get("partial_rotary_factor"), cfg.get("partial_rotary_factor")):
        if value is not None:
            return float(value)
    return GLM_PARTIAL_ROTARY_DEFAULT


def _routing_groups(cfg: dict[str, Any], experts: int, topk: int) -> dict[str, Any]:
    """longspan's group-limited routing for ``n_group`` / ``topk_group`` (none when every group is kept)."""
    groups, keep = int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)
    if groups <= 1 or keep >= groups:
        return {}
    if experts % groups or topk % keep or topk // keep != GLM_GROUP_SCORE_TOPK:
        raise NotSupportedError(
            f"config.json topk_group={keep} with n_group={groups} and num_experts_per_tok={topk} is not supported: "
            f"longspan scores a group by its top num_experts_per_tok // topk_group experts, GLM by its top "
            f"{GLM_GROUP_SCORE_TOPK} (use num_experts_per_tok = {GLM_GROUP_SCORE_TOPK} * topk_group)"
        )
    return dict(moe_router_num_groups=groups, moe_router_group_topk=keep)


def deepseek_moe_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """Provider MoE fields for the DeepSeek-V3-style keys GLM-4.5 and DeepSeek-V3 config.json files share
    (``n_routed_experts``, ``num_experts_per_tok``, ``moe_intermediate_size``, ``n_shared_experts``,
    ``first_k_dense_replace``, ``n_group``, ``topk_group``, ``norm_topk_prob``, ``routed_scaling_factor``)."""
    experts = required(cfg, "n_routed_experts") if cfg.get("num_local_experts") is None else cfg["num_local_experts"]
    topk = int(cfg.get("num_experts_per_tok", 8))
    norm = bool(cfg.get("norm_topk_prob", True))
    if norm != (topk > 1):
        raise NotSupportedError(
            f"config.json norm_topk_prob={str(norm).lower()} with num_experts_per_tok={topk} is not supported: "
            "longspan's sigmoid routing normalizes the chosen scores exactly when more than one expert is chosen"
        )
    dense = int(cfg.get("first_k_dense_replace", 1))
    shared = int(cfg.get("n_shared_experts") or 0)
    moe_ffn = required(cfg, "moe_intermediate_size")
    out = dict(
        num_moe_experts=experts,
        moe_router_topk=topk,
        moe_ffn_hidden_size=moe_ffn,
        moe_shared_expert_intermediate_size=moe_ffn * shared if shared else None,
        moe_layer_freq=[int(i >= dense) for i in range(num_layers)] if dense else 1,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_topk_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        moe_router_dtype="fp32",  # transformers computes the router in float32 in any model dtype
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
    )
    out.update(_routing_groups(cfg, experts, topk))
    return out


def glm4_moe_provider(cfg: dict[str, Any]) -> dict[str, Any]:
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope_cfg = dict(cfg, rope_parameters=dict(rope, partial_rotary_factor=_partial_rotary_factor(cfg)))
    out = decoder_provider(dict(rope_cfg, attention_bias=False), eps_default=1e-5, family="GLM-4.5")
    out.update(add_qkv_bias=bool(cfg.get("attention_bias", False)), qk_layernorm=bool(cfg.get("use_qk_norm", False)))
    out.update(deepseek_moe_fields(cfg, out["num_layers"]))
    out.update(mtp_num_layers=declared_depths(cfg) or None, mtp_loss_scaling_factor=GLM_MTP_LOSS_SCALING_FACTOR)
    return out


def _check_deepseek_moe(p: Any) -> None:
    problems = []
    if not p.num_moe_experts or p.moe_router_score_function != "sigmoid" or not p.moe_router_enable_expert_bias:
        problems.append("an MoE with sigmoid routing and moe_router_enable_expert_bias=True")
    if p.add_bias_linear or getattr(p, "moe_shared_expert_gate", False):
        problems.append("no linear biases but q/k/v's (add_bias_linear=False) and no shared-expert gate")
    if problems:
        raise NotSupportedError(
            f"this model has no DeepSeek-V3-style HF MoE equivalent: it needs {'; '.join(problems)}"
        )


def _dense_prefix(p: Any) -> int:
    """HF's ``first_k_dense_replace`` for provider ``p`` (its MoE layers must be every layer after the first k)."""
    freq = p.moe_layer_freq
    flags = [1] * p.num_layers if freq == 1 else list(freq) if not isinstance(freq, int) else \
        [int(i % freq == 0) for i in range(p.num_layers)]
    dense = flags.index(1) if 1 in flags else p.num_layers
    if flags != [0] * dense + [1] * (p.num_layers - dense):
        raise NotSupportedError(
            f"model.moe_layer_freq={freq!r} has no HF equivalent: the dense layers are the first "
            "first_k_dense_replace layers, every later layer is MoE"
        )
    return dense


def deepseek_moe_hf_fields(p: Any) -> dict[str, Any]:
    """The DeepSeek-V3-style config.json MoE keys of provider ``p`` (one-line error where they cannot say it)."""
    _check_deepseek_moe(p)
    groups, keep = p.moe_router_num_groups, p.moe_router_group_topk
    if groups and keep and p.moe_router_topk // keep != GLM_GROUP_SCORE_TOPK:
        raise NotSupportedError(
            f"model.moe_router_group_topk={keep} with moe_router_topk={p.moe_router_topk} has no HF equivalent: "
            f"DeepSeek-V3 and GLM score a group by its top {GLM_GROUP_SCORE_TOPK} experts"
        )
    shared = p.moe_shared_expert_intermediate_size or 0
    moe_ffn = p.moe_ffn_hidden_size or p.ffn_hidden_size
    if shared % moe_ffn:
        raise NotSupportedError(
            f"model.moe_shared_expert_intermediate_size={shared} has no HF equivalent: it must be a multiple "
            f"of moe_ffn_hidden_size ({moe_ffn})"
        )
    scaling = p.moe_router_topk_scaling_factor
    return dict(
        n_routed_experts=p.num_moe_experts,
        num_experts_per_tok=p.moe_router_topk,
        moe_intermediate_size=moe_ffn,
        n_shared_experts=shared // moe_ffn,
        first_k_dense_replace=_dense_prefix(p),
        n_group=groups or 1,
        topk_group=keep or 1,
        norm_topk_prob=p.moe_router_topk > 1,
        routed_scaling_factor=float(1.0 if scaling is None else scaling),
    )


def glm4_moe_hf(p: Any) -> dict[str, Any]:
    out = decoder_hf(_WithoutQkvBias(p), family="GLM-4.5")
    out.pop("mlp_bias")
    out.pop("partial_rotary_factor", None)
    out.update(
        rope_parameters=dict(out["rope_parameters"], partial_rotary_factor=float(p.rotary_percent)),
        attention_bias=bool(p.add_qkv_bias),
        use_qk_norm=bool(p.qk_layernorm),
    )
    out[HF_MTP_KEY] = int(p.mtp_num_layers or 0)
    out.update(deepseek_moe_hf_fields(p))
    return out


class _WithoutQkvBias:
    """Provider ``p`` seen by ``llama_hf`` without its q/k/v bias (GLM writes ``attention_bias`` itself)."""

    def __init__(self, p: Any) -> None:
        self._p = p

    def __getattr__(self, name: str) -> Any:
        return False if name == "add_qkv_bias" else getattr(self._p, name)
