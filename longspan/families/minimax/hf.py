"""MiniMax-M2 (``MiniMaxM2ForCausalLM``: MiniMax-M2, M2.5, M2.7) as config.json and weights: the standard decoder
with QK-norm over the whole q / k projections (longspan's ``qk_layernorm_across_heads``), RoPE on the first
``rotary_dim`` channels of each head, and a mixture of experts on every layer routed by sigmoid scores chosen with
the aux-loss-free expert bias (``e_score_correction_bias``: longspan's float32 ``router.expert_bias`` buffer) and
normalized over the chosen experts.

config.json: transformers' keys, and the hub's own spellings of what transformers fixes (``rotary_dim``,
``scoring_func``, ``use_routing_bias``, ``use_qk_norm``, ``qk_norm_type``, ``shared_intermediate_size``,
``attn_type_list``): each is read, and a value transformers' model would not compute is refused in one line. The
hub's multi-token-prediction keys (``use_mtp``, ``num_mtp_modules``, ``mtp_transformer_layers``) describe modules
transformers' model does not build and whose weights the published files do not hold (Megatron Bridge maps none
either), so longspan builds none.

Weights: the router ``block_sparse_moe.gate``, its bias ``block_sparse_moe.e_score_correction_bias`` and one HF
module per expert (``w1`` gate, ``w3`` up, ``w2`` down), as transformers writes and the hub holds them.
"""

from __future__ import annotations

from typing import Any

from longspan.conversion.config_fields import required
from longspan.conversion.decoder_fields import decoder_hf, decoder_provider
from longspan.conversion.families import Family
from longspan.conversion.mapping import DECODER_ATTENTION, DECODER_EMBEDDINGS, layer_map
from longspan.core.errors import NotSupportedError

WEIGHTS = DECODER_EMBEDDINGS + DECODER_ATTENTION + (
    layer_map("mlp.router.weight", "block_sparse_moe.gate.weight"),
    layer_map("mlp.router.expert_bias", "block_sparse_moe.e_score_correction_bias", buffer=True),
    layer_map("mlp.experts.linear_fc1_gate.weight", "block_sparse_moe.experts.{e}.w1.weight", per_expert=True),
    layer_map("mlp.experts.linear_fc1.weight", "block_sparse_moe.experts.{e}.w3.weight", per_expert=True),
    layer_map("mlp.experts.linear_fc2.weight", "block_sparse_moe.experts.{e}.w2.weight", per_expert=True),
)

# The hub's config.json keys for what transformers' model always does: key -> (the value it implies, what it says).
HUB_FIXED = {
    "scoring_func": ("sigmoid", "the router's scores are sigmoids"),
    "use_routing_bias": (True, "the expert choice adds e_score_correction_bias"),
    "use_qk_norm": (True, "q and k are normalized"),
    "qk_norm_type": ("per_layer", "the q / k norms span the whole projection"),
}


def _check_hub_keys(cfg: dict[str, Any]) -> None:
    """One-line NotSupportedError for a hub key whose value transformers' MiniMax-M2 would not compute."""
    for key, (value, meaning) in HUB_FIXED.items():
        if key in cfg and cfg[key] != value:
            raise NotSupportedError(f"config.json {key}={cfg[key]!r} is not supported: MiniMax-M2 needs "
                                    f"{key}={value!r} ({meaning})")
    if cfg.get("shared_intermediate_size"):
        raise NotSupportedError(f"config.json shared_intermediate_size={cfg['shared_intermediate_size']!r} is not "
                                "supported: MiniMax-M2 has no shared expert (use 0)")
    kinds = cfg.get("attn_type_list")
    if kinds is not None and any(kind != 1 for kind in kinds):
        raise NotSupportedError("config.json attn_type_list has linear-attention layers (0): MiniMax-M2 has full "
                                "attention (1) on every layer; MiniMax-Text-01's lightning attention is not supported")
    if cfg.get("router_jitter_noise"):
        raise NotSupportedError(f"config.json router_jitter_noise={cfg['router_jitter_noise']!r} is not supported "
                                "(use 0.0)")


def _rotary_percent(cfg: dict[str, Any], head_dim: int, percent: float) -> float:
    """The share of each head that RoPE turns: the hub's ``rotary_dim`` (channels), which transformers reads as
    ``partial_rotary_factor = rotary_dim / head_dim``; both spellings must agree."""
    rotary_dim = cfg.get("rotary_dim")
    if rotary_dim is None:
        return percent
    if not isinstance(rotary_dim, int) or rotary_dim <= 0 or rotary_dim > head_dim or rotary_dim % 2:
        raise NotSupportedError(f"config.json rotary_dim={rotary_dim!r} is not supported: use an even number of "
                                f"channels from 2 to head_dim ({head_dim})")
    from_dim = rotary_dim / head_dim
    params = cfg.get("rope_parameters") or {}
    stated = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if stated is not None and float(stated) != from_dim:
        raise NotSupportedError(f"config.json rotary_dim={rotary_dim} (of head_dim {head_dim}) contradicts "
                                f"partial_rotary_factor={stated}: they must say the same share")
    return from_dim


def minimax_m2_provider(cfg: dict[str, Any]) -> dict[str, Any]:
    """GPTModelProvider keyword arguments of a MiniMax-M2 config.json."""
    _check_hub_keys(cfg)
    topk = int(cfg.get("num_experts_per_tok", 8))
    if topk < 2:
        raise NotSupportedError(f"config.json num_experts_per_tok={topk} is not supported: MiniMax-M2 normalizes the "
                                "chosen scores to sum to one, longspan's sigmoid routing only over two or more")
    out = decoder_provider(cfg, eps_default=1e-6, family="MiniMax-M2")
    head_dim = out.get("kv_channels") or out["hidden_size"] // out["num_attention_heads"]
    percent = _rotary_percent(cfg, head_dim, out.pop("rotary_percent", 1.0))
    if percent != 1.0:
        out["rotary_percent"] = percent
    out.update(
        qk_layernorm=True,
        qk_layernorm_across_heads=True,
        num_moe_experts=required(cfg, "num_local_experts"),
        moe_router_topk=topk,
        moe_ffn_hidden_size=out["ffn_hidden_size"],
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_pre_softmax=False,
        # Megatron Bridge's MiniMax-M2 provider: the load-balancing loss at router_aux_loss_coef
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=float(cfg.get("router_aux_loss_coef", 0.001)),
    )
    return out


def _first(value: Any) -> Any:
    return value[0] if isinstance(value, (list, tuple)) else value


def _check_exportable(p: Any) -> None:
    """One-line NotSupportedError for what a MiniMax-M2 config.json cannot hold."""
    every_layer = p.moe_layer_freq in (1, [1] * p.num_layers)
    scaling = p.moe_router_topk_scaling_factor
    ok = (p.qk_layernorm and p.qk_layernorm_across_heads and p.num_moe_experts and every_layer
          and p.moe_router_score_function == "sigmoid" and p.moe_router_enable_expert_bias
          and p.moe_router_topk >= 2 and not p.moe_router_num_groups and scaling in (None, 1.0)
          and not p.moe_shared_expert_intermediate_size and p.layernorm_before_sublayers
          and not p.layernorm_after_sublayers and not p.layernorm_zero_centered_gamma
          and not p.attention_output_gate and not p.add_qkv_bias and not p.add_bias_linear)
    if not ok:
        raise NotSupportedError(
            "this model has no MiniMax-M2 equivalent (needs QK-norm across heads, pre-norm layers, experts on every "
            "layer with sigmoid top-k (k >= 2) routing, the expert bias, no groups, scaling or shared experts, and "
            "no biases)"
        )


def minimax_m2_hf(p: Any) -> dict[str, Any]:
    """A MiniMax-M2 config.json body for provider ``p`` (transformers' keys, the hub's ``rotary_dim`` and the
    hub's spellings of the fixed choices, which other runtimes read)."""
    _check_exportable(p)
    out = decoder_hf(p, family="MiniMax-M2")
    del out["attention_bias"], out["mlp_bias"]  # MiniMax-M2 has neither key
    head_dim = out["head_dim"]
    out.update(
        intermediate_size=p.moe_ffn_hidden_size or p.ffn_hidden_size,
        num_local_experts=p.num_moe_experts,
        num_experts_per_tok=p.moe_router_topk,
        router_aux_loss_coef=float(_first(p.moe_aux_loss_coeff)),
        router_jitter_noise=0.0,
        rotary_dim=int(round(p.rotary_percent * head_dim)),
        shared_intermediate_size=0,
        **{key: value for key, (value, _) in HUB_FIXED.items()},
    )
    return out


MINIMAX_M2 = Family("minimax_m2", "MiniMaxM2ForCausalLM", "minimax_m2", WEIGHTS, minimax_m2_provider, minimax_m2_hf)
