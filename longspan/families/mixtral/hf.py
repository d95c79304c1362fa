"""Mixtral (``MixtralForCausalLM``): Mistral's decoder with every MLP a mixture of experts, as config.json and
weights."""

from __future__ import annotations

from typing import Any

from longspan.conversion.config_fields import required
from longspan.conversion.decoder_fields import decoder_provider
from longspan.conversion.families import Family
from longspan.conversion.mapping import DECODER_ATTENTION, DECODER_EMBEDDINGS, layer_map
from longspan.core.errors import NotSupportedError
from longspan.families.mistral.hf import mistral_hf

WEIGHTS = DECODER_EMBEDDINGS + DECODER_ATTENTION + (
    layer_map("mlp.router.weight", "block_sparse_moe.gate.weight"),
    layer_map("mlp.experts.linear_fc1_gate.weight", "block_sparse_moe.experts.{e}.w1.weight", per_expert=True),
    layer_map("mlp.experts.linear_fc1.weight", "block_sparse_moe.experts.{e}.w3.weight", per_expert=True),
    layer_map("mlp.experts.linear_fc2.weight", "block_sparse_moe.experts.{e}.w2.weight", per_expert=True),
)


def mixtral_provider(cfg: dict[str, Any]) -> dict[str, Any]:
    """Provider keyword arguments of a Mixtral config.json."""
    out = decoder_provider(cfg, eps_default=1e-5, family="Mixtral")
    # HF Mixtral: softmax over all experts, top-k, renormalized = softmax over the top-k logits
    # (longspan's default, moe_router_pre_softmax=False).
    out.update(
        num_moe_experts=required(cfg, "num_local_experts"),
        moe_router_topk=cfg.get("num_experts_per_tok", 2),
        moe_ffn_hidden_size=cfg["intermediate_size"],
        moe_router_pre_softmax=False,
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=float(cfg.get("router_aux_loss_coef", 0.0)),
    )
    if cfg.get("router_jitter_noise"):
        raise NotSupportedError(f"config.json router_jitter_noise={cfg['router_jitter_noise']} is not supported")
    return out


def mixtral_hf(p: Any) -> dict[str, Any]:
    """A Mixtral config.json body for provider ``p``."""
    if (p.moe_router_pre_softmax or p.moe_layer_freq not in (1, [1] * p.num_layers)
            or p.moe_shared_expert_intermediate_size):
        raise NotSupportedError("Mixtral needs every layer MoE, moe_router_pre_softmax=False and no shared experts")
    out = mistral_hf(p)
    out.update(num_local_experts=p.num_moe_experts, num_experts_per_tok=p.moe_router_topk,
               intermediate_size=p.moe_ffn_hidden_size or p.ffn_hidden_size,
               router_aux_loss_coef=float(_first(p.moe_aux_loss_coeff)))
    return out


def _first(value: Any) -> Any:
    return value[0] if isinstance(value, (list, tuple)) else value


MIXTRAL = Family("mixtral", "MixtralForCausalLM", "mixtral", WEIGHTS, mixtral_provider, mixtral_hf)
