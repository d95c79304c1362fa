"""Config rules of a mixture-of-experts model's fields (``num_moe_experts`` and the ``moe_*`` router, expert
and token-dropping settings), as longspan's MoE layer (``longspan.models.moe``) implements them, and the
routing groups the model's typed arguments share with them (``routing_groups``)."""

from __future__ import annotations

from typing import Any

from longspan.core.errors import ConfigError, NotSupportedError

SUPPORTED_LOAD_BALANCING = ("aux_loss", "none")
ROUTER_DTYPES = (None, "fp32", "fp64")


def single_value(value: Any, field: str) -> Any:
    """A scalar setting that Megatron also accepts as a one-element list."""
    if isinstance(value, (list, tuple)):
        if len(value) != 1:
            raise NotSupportedError(
                f"model.{field}={list(value)!r}: only one load-balancing type (and one coefficient) is supported"
            )
        return value[0]
    return value


def check_moe_layer_freq(freq: Any, num_layers: int) -> None:
    """``moe_layer_freq`` (Megatron's): a positive int n (every n-th layer is MoE) or a 0/1 entry per layer.
    Which layers that makes MoE is ``longspan.models.layer_pattern.moe_layer_flags``."""
    if isinstance(freq, bool) or not isinstance(freq, (int, list, tuple)):
        raise ConfigError(f"model.moe_layer_freq={freq!r} must be a positive int or a 0/1 list per layer")
    if isinstance(freq, int):
        if freq < 1:
            raise ConfigError(f"model.moe_layer_freq={freq} must be >= 1 (or a 0/1 list per layer)")
        return
    if len(freq) != num_layers or any(x not in (0, 1, True, False) for x in freq):
        raise ConfigError(
            f"model.moe_layer_freq={list(freq)!r} must hold one 0/1 entry per layer ({num_layers} layers)"
        )


def routing_groups(config: Any) -> tuple[Any, Any]:
    """(moe_router_num_groups, moe_router_group_topk) of group-limited routing. Device-limited routing
    (``moe_router_topk_limited_devices=M``) is the same routing with one group per expert-parallel rank:
    (expert_model_parallel_size, M), as megatron-core's TransformerConfig maps it."""
    limited = config.moe_router_topk_limited_devices
    if limited:
        return config.expert_model_parallel_size or 1, limited
    return config.moe_router_num_groups, config.moe_router_group_topk


def _check_routing_groups(config: Any, experts: int, topk: int) -> None:
    groups, group_topk = config.moe_router_num_groups, config.moe_router_group_topk
    limited = config.moe_router_topk_limited_devices
    if limited is not None and (isinstance(limited, bool) or not isinstance(limited, int) or limited < 1):
        raise ConfigError(f"model.moe_router_topk_limited_devices={limited!r} must be a positive integer (or None)")
    if limited and (groups or group_topk):
        raise ConfigError(
            f"model.moe_router_topk_limited_devices={limited} and model.moe_router_num_groups={groups!r} / "
            f"model.moe_router_group_topk={group_topk!r} both limit the routing: set only one"
        )
    if limited:
        ep = config.expert_model_parallel_size or 1
        if limited > ep or topk % limited:
            raise ConfigError(
                f"model.moe_router_topk_limited_devices={limited} must be at most expert_model_parallel_size "
                f"({ep}) and divide moe_router_topk ({topk})"
            )
        return
    if bool(groups) != bool(group_topk):
        raise ConfigError(
            f"model.moe_router_num_groups={groups!r} and model.moe_router_group_topk={group_topk!r} must be set together"
        )
    if groups and (experts % groups or group_topk > groups or topk % group_topk):
        raise ConfigError(
            f"group-limited routing needs num_moe_experts ({experts}) divisible by moe_router_num_groups ({groups}), "
            f"moe_router_group_topk ({group_topk}) <= moe_router_num_groups and dividing moe_router_topk ({topk})"
        )


def _check_aux_loss_free_routing(config: Any, score: str) -> None:
    """The expert bias (sigmoid scores only, as megatron-core) and the router input jitter."""
    if config.moe_router_enable_expert_bias:
        if score != "sigmoid":
            raise ConfigError(
                f"model.moe_router_enable_expert_bias=True needs model.moe_router_score_function='sigmoid' "
                f"(got {score!r})"
            )
        if config.moe_pad_expert_input_to_capacity:
            # megatron-core counts the padded routing map: every expert at its capacity, so the bias never moves.
            raise ConfigError(
                "model.moe_router_enable_expert_bias=True with model.moe_pad_expert_input_to_capacity=True: every "
                "expert's padded input is its capacity, so the bias would never move; unset one of them"
            )
        rate = config.moe_router_bias_update_rate
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate >= 0:
            raise ConfigError(f"model.moe_router_bias_update_rate={rate!r} must be a number >= 0")
    eps = config.moe_input_jitter_eps
    if eps is not None and (isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1):
        raise ConfigError(f"model.moe_input_jitter_eps={eps!r} must be between 0 and 1 (exclusive), or None")


def _check_latent_size(config: Any) -> None:
    """``moe_latent_size``: a positive width that tensor parallel divides (it splits both latent projections
    along the latent: ``longspan.parallel.expert_parallel``)."""
    latent = config.moe_latent_size
    if latent is None:
        return
    if isinstance(latent, bool) or not isinstance(latent, int) or latent < 1:
        raise ConfigError(f"model.moe_latent_size={latent!r} must be a positive integer (or None: no latent space)")
    tp = config.tensor_model_parallel_size or 1
    if latent % tp:
        raise ConfigError(
            f"model.moe_latent_size={latent} is not divisible by model.tensor_model_parallel_size={tp}: tensor "
            "parallel splits the MoE latent projections along the latent; use a tp that divides it"
        )


def check_moe(config: Any) -> None:
    """The MoE fields' checks (nothing to check for a dense model: ``num_moe_experts`` None or 0)."""
    experts = config.num_moe_experts
    if not experts:
        return
    if isinstance(experts, bool) or not isinstance(experts, int) or experts < 1:
        raise ConfigError(f"model.num_moe_experts={experts!r} must be a positive integer (or None for dense)")
    topk = config.moe_router_topk
    if not isinstance(topk, int) or not 1 <= topk <= experts:
        raise ConfigError(f"model.moe_router_topk={topk!r} must be between 1 and num_moe_experts={experts}")
    balancing = single_value(config.moe_router_load_balancing_type,
                             "moe_router_load_balancing_type")
    if balancing not in SUPPORTED_LOAD_BALANCING:
        raise NotSupportedError(
            f"model.moe_router_load_balancing_type={balancing!r} is not supported: use 'aux_loss' or 'none'"
        )
    single_value(config.moe_aux_loss_coeff, "moe_aux_loss_coeff")
    score = config.moe_router_score_function
    if score not in ("softmax", "sigmoid"):
        raise ConfigError(f"model.moe_router_score_function={score!r} must be 'softmax' or 'sigmoid'")
    _check_routing_groups(config, experts, topk)
    _check_aux_loss_free_routing(config, score)
    if config.moe_router_dtype not in ROUTER_DTYPES:
        raise ConfigError(f"model.moe_router_dtype={config.moe_router_dtype!r} must be None, 'fp32' or 'fp64'")
    capacity = config.moe_expert_capacity_factor
    if capacity is not None and capacity <= 0:
        raise ConfigError(f"model.moe_expert_capacity_factor={capacity!r} must be positive (or None: dropless)")
    drop_policy = config.moe_token_drop_policy
    if drop_policy not in ("probs", "position"):
        raise ConfigError(f"model.moe_token_drop_policy={drop_policy!r} must be 'probs' or 'position'")
    if config.moe_pad_expert_input_to_capacity and capacity is None:
        raise ConfigError("model.moe_pad_expert_input_to_capacity=True needs model.moe_expert_capacity_factor")
    if config.moe_token_dropping and capacity is None:
        raise ConfigError(
            "model.moe_token_dropping=True needs model.moe_expert_capacity_factor (the capacity beyond which "
            "tokens are dropped; None means dropless)"
        )
    _check_latent_size(config)
    if config.moe_layer_recompute and config.recompute_granularity == "full":
        raise ConfigError(
            "model.moe_layer_recompute=True with model.recompute_granularity='full': full recompute already "
            "replays every layer; use moe_layer_recompute with None or 'selective'"
        )
