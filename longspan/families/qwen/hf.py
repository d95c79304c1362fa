"""Qwen2, Qwen3 and Qwen3-MoE (``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``, ``Qwen3MoeForCausalLM``): the
standard decoder with q/k/v biases (Qwen2), per-head QK-norm (Qwen3) and mixture-of-experts MLPs (Qwen3-MoE),
as config.json and weights."""

from __future__ import annotations

from typing import Any

from longspan.conversion.config_fields import required, window_fields, window_hf
from longspan.conversion.decoder_fields import NO_WINDOW, decoder_hf, decoder_provider, provider_view
from longspan.conversion.families import Family
from longspan.conversion.mapping import DECODER, layer_map
from longspan.core.errors import NotSupportedError

# Dense layers (mlp_only_layers / decoder_sparse_step) keep the standard decoder's MLP names.
QWEN3_MOE_WEIGHTS = DECODER + (
    layer_map("mlp.router.weight", "mlp.gate.weight"),
    layer_map("mlp.experts.linear_fc1_gate.weight", "mlp.experts.{e}.gate_proj.weight", per_expert=True),
    layer_map("mlp.experts.linear_fc1.weight", "mlp.experts.{e}.up_proj.weight", per_expert=True),
    layer_map("mlp.experts.linear_fc2.weight", "mlp.experts.{e}.down_proj.weight", per_expert=True),
)


def qwen2_provider(cfg: dict[str, Any]) -> dict[str, Any]:
    """Provider keyword arguments of a Qwen2 config.json."""
    # transformers' Qwen2: the window applies only with use_sliding_window, on the layers layer_types marks
    # (default: layers >= max_window_layers).
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    layers = required(cfg, "num_hidden_layers")
    layer_types = cfg.get("layer_types")
    if window is not None and not layer_types:
        first_sliding = cfg.get("max_window_layers", 28)
        layer_types = ["sliding_attention" if i >= first_sliding else "full_attention" for i in range(layers)]
    out = decoder_provider(dict(cfg, attention_bias=False, use_sliding_window=False, sliding_window=None),
                           family="Qwen2")
    out["add_qkv_bias"] = True  # Qwen2 always has q/k/v biases (and none elsewhere)
    return dict(out, **window_fields(window, layer_types, layers))


def qwen2_hf(p: Any) -> dict[str, Any]:
    """A Qwen2 config.json body for provider ``p``."""
    if not p.add_qkv_bias or p.add_bias_linear:
        raise NotSupportedError("Qwen2 needs add_qkv_bias=True and add_bias_linear=False")
    out = decoder_hf(provider_view(p, add_qkv_bias=False, **NO_WINDOW), family="Qwen2")
    for key in ("attention_bias", "mlp_bias"):
        out.pop(key)
    window, layer_types = window_hf(p)
    if window is None:
        return dict(out, use_sliding_window=False, sliding_window=None)
    full_prefix = layer_types.index("sliding_attention")
    return dict(out, use_sliding_window=True, sliding_window=window, max_window_layers=full_prefix,
                layer_types=layer_types)


def qwen3_provider(cfg: dict[str, Any]) -> dict[str, Any]:
    """Provider keyword arguments of a Qwen3 config.json."""
    return dict(decoder_provider(cfg, family="Qwen3"), qk_layernorm=True)


def qwen3_hf(p: Any) -> dict[str, Any]:
    """A Qwen3 config.json body for provider ``p``."""
    if not p.qk_layernorm:
        raise NotSupportedError("Qwen3 needs qk_layernorm=True")
    out = decoder_hf(p, family="Qwen3")
    out.pop("mlp_bias")
    return dict(out, use_sliding_window=False, sliding_window=None)


def _first(value: Any) -> Any:
    return value[0] if isinstance(value, (list, tuple)) else value


def qwen3_moe_provider(cfg: dict[str, Any]) -> dict[str, Any]:
    """Provider keyword arguments of a Qwen3-MoE config.json."""
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
    """A Qwen3-MoE config.json body for provider ``p``."""
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


QWEN2 = Family("qwen2", "Qwen2ForCausalLM", "qwen2", DECODER, qwen2_provider, qwen2_hf)
QWEN3 = Family("qwen3", "Qwen3ForCausalLM", "qwen3", DECODER, qwen3_provider, qwen3_hf)
QWEN3_MOE = Family("qwen3_moe", "Qwen3MoeForCausalLM", "qwen3_moe", QWEN3_MOE_WEIGHTS, qwen3_moe_provider,
                   qwen3_moe_hf)
