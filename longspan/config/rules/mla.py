"""Multi-latent attention's rules (DeepSeek's MLA): its sizes, and the plain attention fields it does not read."""

from __future__ import annotations

from typing import Any

from longspan.core.errors import ConfigError, NotSupportedError

# Fields a multi-latent attention layer does not read (its own fields replace them), at the values that mean
# "nothing asked for".
MLA_UNUSED_FIELDS: dict[str, Any] = {
    "add_qkv_bias": False,
    "rotary_interleaved": False,
    "rotary_percent": 1.0,
    "softmax_scale": None,
    "window_size": None,
    "rope_scaling": False,
    "rope_dynamic_factor": None,
    "rope_longrope_short_factor": None,
}

# YaRN fields of the plain attention and the multi-latent attention field each stands for.
MLA_YARN_FIELDS = {"yarn_rotary_scaling_factor": "rotary_scaling_factor", "yarn_mscale": "mscale",
                   "yarn_mscale_all_dim": "mscale_all_dim"}


def check_mla(config: Any) -> None:
    """Multi-latent attention's sizes (positive; an even rotary part) and the attention fields it does not read
    left at their defaults; under YaRN, the plain attention's yarn_* factor and mscales either unset or equal to
    MLA's own (rotary_scaling_factor, mscale, mscale_all_dim, which are what MLA reads)."""
    if config.position_embedding_type not in ("rope", "yarn"):
        raise NotSupportedError(
            f"model.position_embedding_type={config.position_embedding_type!r} is not supported with "
            "multi_latent_attention: use 'rope' or 'yarn'"
        )
    for name, default in MLA_UNUSED_FIELDS.items():
        value = getattr(config, name, default)
        if value != default and not (default is False and not value):
            raise NotSupportedError(
                f"model.{name}={value!r} is not supported with multi_latent_attention: leave it at {default!r}"
            )
    q_lora_rank = config.q_lora_rank
    if q_lora_rank is not None and (not isinstance(q_lora_rank, int) or q_lora_rank < 1):
        raise ConfigError(f"model.q_lora_rank={q_lora_rank!r} must be a positive int (or None: no query compression)")
    for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
        value = getattr(config, name)
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"model.{name}={value!r} must be a positive int (multi_latent_attention)")
    if config.qk_pos_emb_head_dim % 2 != 0:
        raise ConfigError(f"model.qk_pos_emb_head_dim={config.qk_pos_emb_head_dim} must be even (rotary pairs)")
    if config.num_attention_heads <= 0:
        raise ConfigError(f"model.num_attention_heads={config.num_attention_heads} must be positive")
    groups = config.num_query_groups
    if groups not in (None, config.num_attention_heads):
        raise NotSupportedError(
            f"model.num_query_groups={groups} is not supported with multi_latent_attention (every head has its own "
            f"keys and values from the latent): leave it None or {config.num_attention_heads}"
        )
    for name in ("rotary_scaling_factor", "mscale"):
        if getattr(config, name) <= 0:
            raise ConfigError(f"model.{name}={getattr(config, name)!r} must be positive (multi_latent_attention)")
    eps = getattr(config, "mla_latent_layernorm_epsilon", None)  # getattr: declared by GPT providers only
    if eps is not None and (isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps <= 0):
        raise ConfigError(f"model.mla_latent_layernorm_epsilon={eps!r} must be a positive number (or None: "
                          "layernorm_epsilon)")
    if eps is not None and not config.qk_layernorm:
        raise ConfigError(f"model.mla_latent_layernorm_epsilon={eps!r} needs qk_layernorm=True (without it multi-latent "
                          "attention has no latent norms): leave it None")
    for yarn_name, mla_name in MLA_YARN_FIELDS.items():
        value = getattr(config, yarn_name, None)
        if value is not None and value != getattr(config, mla_name):
            raise ConfigError(
                f"model.{yarn_name}={value!r} differs from model.{mla_name}={getattr(config, mla_name)!r}: "
                f"multi-latent attention reads {mla_name}; leave {yarn_name} None"
            )


def check_no_mla_fields(config: Any) -> None:
    """Without multi-latent attention nothing reads MLA's own latent-norm epsilon: one-line error when it is set."""
    eps = getattr(config, "mla_latent_layernorm_epsilon", None)  # getattr: GPT providers declare it, Mamba's not
    if eps is not None:
        raise ConfigError(f"model.mla_latent_layernorm_epsilon={eps!r} needs multi_latent_attention=True (it is the "
                          "latent norms' epsilon): leave it None")
