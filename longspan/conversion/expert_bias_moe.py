"""The mixture of experts with sigmoid routing, the aux-loss-free expert bias, group-limited top-k and shared
experts, as config.json keys and weight names (the families that have it share both).

config.json: ``n_routed_experts``, ``num_experts_per_tok``, ``moe_intermediate_size``, ``n_shared_experts``,
``first_k_dense_replace``, ``n_group``, ``topk_group``, ``norm_topk_prob``, ``routed_scaling_factor``. Routing:
sigmoid scores, the choice made on ``scores + e_score_correction_bias`` (longspan's float32
``router.expert_bias`` buffer, ``moe_router_enable_expert_bias``), group-limited top-k (a group scores the sum of
its top two), the chosen unbiased scores normalized (``norm_topk_prob``) and scaled by ``routed_scaling_factor``;
router logits in float32; ``n_shared_experts`` shared experts as one MLP of ``n_shared_experts *
moe_intermediate_size``; the first ``first_k_dense_replace`` layers dense, the rest MoE.
"""

from __future__ import annotations

from typing import Any

from longspan.conversion.config_fields import required
from longspan.conversion.mapping import layer_map
from longspan.core.errors import NotSupportedError

# transformers' routers score each expert group by the sum of its top two scores.
GROUP_SCORE_TOPK = 2

# The MoE layers: a sigmoid router with the aux-loss-free routing bias (a float32 buffer on
# both sides), routed experts one HF module each, shared experts as one dense MLP. Dense first layers keep
# Llama's MLP names.
EXPERT_BIAS_MOE_MLP = (
    layer_map("mlp.router.weight", "mlp.gate.weight"),
    layer_map("mlp.router.expert_bias", "mlp.gate.e_score_correction_bias", buffer=True),
    layer_map("mlp.experts.linear_fc1_gate.weight", "mlp.experts.{e}.gate_proj.weight", per_expert=True),
    layer_map("mlp.experts.linear_fc1.weight", "mlp.experts.{e}.up_proj.weight", per_expert=True),
    layer_map("mlp.experts.linear_fc2.weight", "mlp.experts.{e}.down_proj.weight", per_expert=True),
    layer_map("mlp.shared_experts.linear_fc1_gate.weight", "mlp.shared_experts.gate_proj.weight"),
    layer_map("mlp.shared_experts.linear_fc1.weight", "mlp.shared_experts.up_proj.weight"),
    layer_map("mlp.shared_experts.linear_fc2.weight", "mlp.shared_experts.down_proj.weight"),
)


def _routing_groups(cfg: dict[str, Any], experts: int, topk: int) -> dict[str, Any]:
    """longspan's group-limited routing for ``n_group`` / ``topk_group`` (none when every group is kept)."""
    groups, keep = int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)
    if groups <= 1 or keep >= groups:
        return {}
    if experts % groups or topk % keep or topk // keep != GROUP_SCORE_TOPK:
        raise NotSupportedError(
            f"config.json topk_group={keep} with n_group={groups} and num_experts_per_tok={topk} is not supported: "
            f"longspan scores a group by its top num_experts_per_tok // topk_group experts, HF by its top "
            f"{GROUP_SCORE_TOPK} (use num_experts_per_tok = {GROUP_SCORE_TOPK} * topk_group)"
        )
    return dict(moe_router_num_groups=groups, moe_router_group_topk=keep)


def sigmoid_routing_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Provider fields of the routed experts and their routing for the config.json keys ``n_routed_experts``,
    ``num_experts_per_tok``, ``moe_intermediate_size``, ``n_group``, ``topk_group``, ``norm_topk_prob`` and
    ``routed_scaling_factor`` (no shared experts, no layer choice)."""
    experts = required(cfg, "n_routed_experts") if cfg.get("num_local_experts") is None else cfg["num_local_experts"]
    topk = int(cfg.get("num_experts_per_tok", 8))
    norm = bool(cfg.get("norm_topk_prob", True))
    if norm != (topk > 1):
        raise NotSupportedError(
            f"config.json norm_topk_prob={str(norm).lower()} with num_experts_per_tok={topk} is not supported: "
            "longspan's sigmoid routing normalizes the chosen scores exactly when more than one expert is chosen"
        )
    out = dict(
        num_moe_experts=experts,
        moe_router_topk=topk,
        moe_ffn_hidden_size=required(cfg, "moe_intermediate_size"),
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_topk_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        moe_router_dtype="fp32",  # transformers computes the router in float32 in any model dtype
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
    )
    out.update(_routing_groups(cfg, experts, topk))
    return out


def expert_bias_moe_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """Provider MoE fields for the config.json keys of this MoE: ``sigmoid_routing_fields``' and
    ``n_shared_experts``, ``first_k_dense_replace``."""
    out = sigmoid_routing_fields(cfg)
    dense = int(cfg.get("first_k_dense_replace", 1))
    shared = int(cfg.get("n_shared_experts") or 0)
    out.update(
        moe_shared_expert_intermediate_size=out["moe_ffn_hidden_size"] * shared if shared else None,
        moe_layer_freq=[int(i >= dense) for i in range(num_layers)] if dense else 1,
    )
    return out


def _check_moe(p: Any) -> None:
    problems = []
    if not p.num_moe_experts or p.moe_router_score_function != "sigmoid" or not p.moe_router_enable_expert_bias:
        problems.append("an MoE with sigmoid routing and moe_router_enable_expert_bias=True")
    if p.add_bias_linear or p.moe_shared_expert_gate:
        problems.append("no linear biases but q/k/v's (add_bias_linear=False) and no shared-expert gate")
    if problems:
        raise NotSupportedError(
            f"this model has no HF equivalent of a sigmoid-routed MoE with shared experts: it needs {'; '.join(problems)}"
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


def sigmoid_routing_hf_fields(p: Any) -> dict[str, Any]:
    """The config.json keys of provider ``p``'s routed experts and routing (``sigmoid_routing_fields``' keys;
    one-line error where they cannot say it)."""
    _check_moe(p)
    groups, keep = p.moe_router_num_groups, p.moe_router_group_topk
    if groups and keep and p.moe_router_topk // keep != GROUP_SCORE_TOPK:
        raise NotSupportedError(
            f"model.moe_router_group_topk={keep} with moe_router_topk={p.moe_router_topk} has no HF equivalent: "
            f"HF scores a group by its top {GROUP_SCORE_TOPK} experts"
        )
    scaling = p.moe_router_topk_scaling_factor
    return dict(
        n_routed_experts=p.num_moe_experts,
        num_experts_per_tok=p.moe_router_topk,
        moe_intermediate_size=p.moe_ffn_hidden_size or p.ffn_hidden_size,
        n_group=groups or 1,
        topk_group=keep or 1,
        norm_topk_prob=p.moe_router_topk > 1,
        routed_scaling_factor=float(1.0 if scaling is None else scaling),
    )


def expert_bias_moe_hf_fields(p: Any) -> dict[str, Any]:
    """The config.json MoE keys of provider ``p`` (one-line error where they cannot say it)."""
    out = sigmoid_routing_hf_fields(p)
    shared = p.moe_shared_expert_intermediate_size or 0
    moe_ffn = out["moe_intermediate_size"]
    if shared % moe_ffn:
        raise NotSupportedError(
            f"model.moe_shared_expert_intermediate_size={shared} has no HF equivalent: it must be a multiple "
            f"of moe_ffn_hidden_size ({moe_ffn})"
        )
    out.update(n_shared_experts=shared // moe_ffn, first_k_dense_replace=_dense_prefix(p))
    return out
