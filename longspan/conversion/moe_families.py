"""Mixture-of-experts families' config translations: Mixtral and Qwen3-MoE (built on the dense ones)."""

from __future__ import annotations

from typing import Any

from longspan.conversion.config_fields import required
from longspan.conversion.dense_families import llama_provider, mistral_hf, qwen3_hf, qwen3_provider
from longspan.core.errors import NotSupportedError


def mixtral_provider(cfg: dict[str, Any]) -> dict[str, Any]:
    out = llama_provider(cfg, eps_default=1e-5)
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
    if p.moe_router_pre_softmax or p.moe_layer_freq not in (1, [1] * p.num_layers) or p.moe_shared_expert_intermediate_size:
        raise NotSupportedError("Mixtral needs every layer MoE, moe_router_pre_softmax=False and no shared experts")
    out = mistral_hf(p)
    out.update(num_local_experts=p.num_moe_experts, num_experts_per_tok=p.moe_router_topk,
               intermediate_size=p.moe_ffn_hidden_size or p.ffn_hidden_size,
               router_aux_loss_coef=float(_first(p.moe_aux_loss_coeff)))
    return out


def _first(value: Any) -> Any:
    return value[0] if isinstance(value, (list, tuple)) else value


def qwen3_moe_provider(cfg: dict[str, Any]) -> dict[str, Any]:
    out = qwen3_provider(cfg)
    layers = out["num_layers"]
    step = int(cfg.get("decoder_sparse_step", 1))
    dense = set(cfg.get("mlp_only_layers") or [])
    flags = [int(i not in dense and (i + 1) % step == 0) for i in range(layers)]
    # HF Qwen3-MoE: softmax over all experts, top-k; renormalized only with norm_topk_prob.
    out.update(
        num_moe_experts=cfg.get("num_experts") or required(cfg, "num_local_experts"),
        moe_router_topk=cfg.get("num_experts_per_tok", 8),
        moe_ffn_hidden_size=required(cfg, "moe_intermediate_size"),
        moe_layer_freq=1 if all(flags) else flags,
        moe_router_pre_softmax=not bool(cfg.get("norm_topk_prob", False)),
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=float(cfg.get("router_aux_loss_coef", 0.0)),
    )
    return out


def qwen3_moe_hf(p: Any) -> dict[str, Any]:
    if p.moe_shared_expert_intermediate_size:
        raise NotSupportedError("Qwen3-MoE has no shared experts")
    out = qwen3_hf(p)
    freq = p.moe_layer_freq
    flags = [1] * p.num_layers if freq == 1 else list(freq)
    if isinstance(freq, int) and freq != 1:
        flags = [int(i % freq == 0) for i in range(p.num_layers)]
    out.update(num_experts=p.num_moe_experts, num_local_experts=p.num_moe_experts,
               num_experts_per_tok=p.moe_router_topk, moe_intermediate_size=p.moe_ffn_hidden_size or p.ffn_hidden_size,
               norm_topk_prob=not p.moe_router_pre_softmax, decoder_sparse_step=1,
               mlp_only_layers=[i for i, f in enumerate(flags) if not f],
               router_aux_loss_coef=float(_first(p.moe_aux_loss_coeff)))
    return out
