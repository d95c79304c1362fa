"""OLMoE (``OlmoeForCausalLM``): the standard decoder with QK-norm over the whole q / k projections (across heads,
as OLMo-2) and a mixture of experts on every layer (softmax over all experts, top-k, renormalised only with
``norm_topk_prob``), as config.json and weights."""

from __future__ import annotations

from typing import Any

from longspan.conversion.config_fields import required
from longspan.conversion.decoder_fields import decoder_hf, decoder_provider
from longspan.conversion.families import Family
from longspan.conversion.mapping import DECODER_ATTENTION, DECODER_EMBEDDINGS, WeightMap
from longspan.core.errors import NotSupportedError


def _layer(ours: str, hf: str, **kw: Any) -> WeightMap:
    return WeightMap(f"decoder.layers.{{i}}.{ours}", f"model.layers.{{i}}.{hf}", **kw)


# The standard decoder's attention (q_norm / k_norm span the whole projections: longspan's q_layernorm /
# k_layernorm across heads) and one HF module per expert.
OLMOE = DECODER_EMBEDDINGS + DECODER_ATTENTION + (
    _layer("mlp.router.weight", "mlp.gate.weight"),
    _layer("mlp.experts.linear_fc1_gate.weight", "mlp.experts.{e}.gate_proj.weight", per_expert=True),
    _layer("mlp.experts.linear_fc1.weight", "mlp.experts.{e}.up_proj.weight", per_expert=True),
    _layer("mlp.experts.linear_fc2.weight", "mlp.experts.{e}.down_proj.weight", per_expert=True),
)


def olmoe_provider(cfg: dict[str, Any]) -> dict[str, Any]:
    """GPTModelProvider keyword arguments of an OLMoE config.json."""
    if cfg.get("clip_qkv") is not None:
        raise NotSupportedError(f"config.json clip_qkv={cfg['clip_qkv']!r} is not supported: longspan does not clamp "
                                "the q/k/v projections (OLMoE checkpoints use null)")
    out = decoder_provider(cfg, eps_default=1e-5, family="OLMoE")
    out.update(
        qk_layernorm=True,
        qk_layernorm_across_heads=True,
        num_moe_experts=required(cfg, "num_experts"),
        moe_router_topk=int(cfg.get("num_experts_per_tok", 8)),
        moe_ffn_hidden_size=out["ffn_hidden_size"],
        # softmax over all experts, then top-k; the top-k weights are renormalised only with norm_topk_prob
        moe_router_pre_softmax=not bool(cfg.get("norm_topk_prob", False)),
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=float(cfg.get("router_aux_loss_coef", 0.01)),
    )
    return out


def _first(value: Any) -> Any:
    return value[0] if isinstance(value, (list, tuple)) else value


def _check_exportable(p: Any) -> None:
    """One-line NotSupportedError for what an OLMoE config.json cannot hold."""
    ok = (p.qk_layernorm and p.qk_layernorm_across_heads and p.num_moe_experts and p.moe_layer_freq == 1
          and p.layernorm_before_sublayers and not p.layernorm_after_sublayers
          and not p.moe_shared_expert_intermediate_size and p.moe_router_score_function == "softmax"
          and not p.moe_router_topk_scaling_factor and not p.add_qkv_bias)
    if not ok:
        raise NotSupportedError(
            "this model has no OLMoE equivalent (needs QK-norm across heads, pre-norm layers, experts on every layer "
            "with softmax routing and no shared experts, and no biases)"
        )
    if (p.kv_channels or p.hidden_size // p.num_attention_heads) * p.num_attention_heads != p.hidden_size:
        raise NotSupportedError("OLMoE's q_norm spans hidden_size: it needs num_attention_heads × kv_channels = "
                                "hidden_size")


def olmoe_hf(p: Any) -> dict[str, Any]:
    """An OLMoE config.json body for provider ``p``."""
    _check_exportable(p)
    out = decoder_hf(p, family="OLMoE")
    del out["head_dim"], out["mlp_bias"]  # OLMoE has neither key (head_dim is hidden_size / heads)
    out.update(intermediate_size=p.moe_ffn_hidden_size or p.ffn_hidden_size, num_experts=p.num_moe_experts,
               num_experts_per_tok=p.moe_router_topk, norm_topk_prob=not p.moe_router_pre_softmax,
               router_aux_loss_coef=float(_first(p.moe_aux_loss_coeff)), clip_qkv=None)
    return out


OLMOE_FAMILY = Family("olmoe", "OlmoeForCausalLM", "olmoe", OLMOE, olmoe_provider, olmoe_hf)
