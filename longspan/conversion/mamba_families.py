"""State-space families' config translations: Mamba-2 and the Nemotron-H hybrids."""

from __future__ import annotations

from typing import Any

import longspan.conversion.mapping as mapping
from longspan.conversion.config_fields import dtype_fields, required, vocab_divisor
from longspan.core.errors import ConfigError, NotSupportedError
from longspan.models.activations import squared_relu
from longspan.models.layer_pattern import layer_windows
from longspan.models.mamba import allocate_layers


def _mamba_mixer_fields(cfg: dict[str, Any], heads_key: str, head_dim_key: str, state_key: str, act_key: str,
                       limit: tuple[float, float] | None) -> dict[str, Any]:
    """MambaProvider fields of a Mamba-2 mixer's config.json keys (shared by Mamba2 and Nemotron-H)."""
    if cfg.get(act_key, "silu") != "silu":
        raise NotSupportedError(f"config.json {act_key}={cfg[act_key]!r} is not supported: longspan's Mamba uses silu")
    for key, default in (("use_conv_bias", True), ("use_bias", False), ("mamba_proj_bias", False)):
        if key in cfg and bool(cfg[key]) != default:
            raise NotSupportedError(f"config.json {key}={cfg[key]!r} is not supported: longspan needs {default}")
    # transformers writes infinity as {"__float__": "Infinity"}
    got = tuple(float(x["__float__"] if isinstance(x, dict) else x)
                for x in (cfg.get("time_step_limit") or (0.0, float("inf"))))
    if limit is not None and got != limit:
        raise NotSupportedError(f"config.json time_step_limit={list(got)} is not supported: longspan needs {list(limit)}")
    return dict(
        mamba_num_heads=required(cfg, heads_key),
        mamba_head_dim=required(cfg, head_dim_key),
        mamba_state_dim=required(cfg, state_key),
        mamba_num_groups=int(cfg.get("n_groups", 8)),
        mamba_conv_kernel=int(cfg.get("conv_kernel", 4)),
        mamba_chunk_size=int(cfg.get("chunk_size", 256)),
    )


def _mixer_sizes(cfg: dict[str, Any], heads_key: str, head_dim_key: str, state_key: str) -> tuple[int, int, int]:
    """(d_inner, groups · state, heads): the sizes of the fused in_proj / conv1d segments (1s when absent)."""
    heads = int(cfg.get(heads_key) or 1)
    return heads * int(cfg.get(head_dim_key) or 1), int(cfg.get("n_groups", 8)) * int(cfg.get(state_key) or 1), heads


def mamba2_weights(cfg: dict[str, Any]) -> tuple[mapping.WeightMap, ...]:
    """Mamba-2's table for config.json ``cfg``: the fused in_proj / conv1d split by its mixer sizes."""
    return mapping.mamba2(*_mixer_sizes(cfg, "num_heads", "head_dim", "state_size"))


def nemotron_h_weights(cfg: dict[str, Any]) -> tuple[mapping.WeightMap, ...]:
    """Nemotron-H's table for config.json ``cfg`` (as ``mamba2_weights``)."""
    return mapping.nemotron_h(*_mixer_sizes(cfg, "mamba_num_heads", "mamba_head_dim", "ssm_state_size"))


def _mamba_mixer_hf(p: Any) -> dict[str, Any]:
    if p.layernorm_zero_centered_gamma:
        raise NotSupportedError("model.layernorm_zero_centered_gamma=True has no Mamba-2 / Nemotron-H config.json "
                                "form (their norms store gamma itself): export a model trained without it")
    heads = p.mamba_num_heads or p.mamba_expand * p.hidden_size // p.mamba_head_dim
    return dict(n_groups=p.mamba_num_groups, conv_kernel=p.mamba_conv_kernel, chunk_size=p.mamba_chunk_size,
                use_conv_bias=True, use_bias=False, heads=heads)


def _shared_fields(cfg: dict[str, Any], vocab: int) -> dict[str, Any]:
    """What Mamba-2 and Nemotron-H read alike: vocabulary, RMSNorm, no position embedding, tied embeddings."""
    return dict(
        vocab_size=vocab,
        make_vocab_size_divisible_by=vocab_divisor(vocab),
        normalization="RMSNorm",
        layernorm_epsilon=float(cfg.get("layer_norm_epsilon", 1e-5)),
        position_embedding_type="none",
        share_embeddings_and_output_weights=bool(cfg.get("tie_word_embeddings", False)),
    )


def mamba2_provider(cfg: dict[str, Any]) -> dict[str, Any]:
    layers = required(cfg, "num_hidden_layers")
    vocab = required(cfg, "vocab_size")
    if cfg.get("hidden_size", 0) * cfg.get("expand", 2) != cfg.get("num_heads", 0) * cfg.get("head_dim", 0):
        raise ConfigError("config.json hidden_size × expand must equal num_heads × head_dim (transformers' own rule)")
    out = dict(
        num_layers=layers,
        hybrid_override_pattern="M" * layers,
        hidden_size=required(cfg, "hidden_size"),
        mamba_expand=int(cfg.get("expand", 2)),
        **_shared_fields(cfg, vocab),
        hidden_dropout=0.0,
        init_method_std=float(cfg.get("initializer_range", 0.1)),
    )
    out.update(_mamba_mixer_fields(cfg, "num_heads", "head_dim", "state_size", "hidden_act", (0.0, float("inf"))))
    out.update(dtype_fields(cfg))
    return out


def mamba2_hf(p: Any) -> dict[str, Any]:
    pattern = p.hybrid_override_pattern
    if (pattern is not None and set(pattern) != {"M"}) or p.hybrid_attention_ratio or p.hybrid_mlp_ratio:
        raise NotSupportedError("Mamba2ForCausalLM has Mamba layers only: export a hybrid model as NemotronH")
    if p.normalization != "RMSNorm":
        raise NotSupportedError("Mamba2ForCausalLM needs normalization='RMSNorm'")
    mixer = _mamba_mixer_hf(p)
    heads = mixer.pop("heads")
    if heads * p.mamba_head_dim % p.hidden_size:
        raise NotSupportedError("Mamba2ForCausalLM needs d_inner (heads × head_dim) to be a multiple of hidden_size")
    return dict(
        vocab_size=p.vocab_size, hidden_size=p.hidden_size, num_hidden_layers=p.num_layers, num_heads=heads,
        head_dim=p.mamba_head_dim, state_size=p.mamba_state_dim, expand=heads * p.mamba_head_dim // p.hidden_size,
        layer_norm_epsilon=p.layernorm_epsilon, hidden_act="silu", residual_in_fp32=True, initializer_range=float(p.init_method_std),
        tie_word_embeddings=bool(p.share_embeddings_and_output_weights), **mixer,
    )


_NEMOTRON_H_SYMBOLS = {"linear_attention": "M", "mamba": "M", "full_attention": "*", "attention": "*", "mlp": "-",
                       "moe": "E"}


_NEMOTRON_H_TYPES = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}


def nemotron_h_provider(cfg: dict[str, Any]) -> dict[str, Any]:
    types = cfg.get("layers_block_type")
    if types:
        unknown = sorted(set(types) - set(_NEMOTRON_H_SYMBOLS))
        if unknown:
            raise NotSupportedError(f"config.json layers_block_type has {unknown}: longspan reads {sorted(_NEMOTRON_H_SYMBOLS)}")
        pattern = "".join(_NEMOTRON_H_SYMBOLS[t] for t in types)
    else:
        pattern = required(cfg, "hybrid_override_pattern")
    if "E" in pattern:
        raise NotSupportedError("config.json: Nemotron-H MoE layers ('moe' / 'E') are not supported yet by longspan")
    for key in ("attention_bias", "mlp_bias", "sliding_window"):
        if cfg.get(key):
            raise NotSupportedError(f"config.json {key}={cfg[key]!r} is not supported for Nemotron-H")
    if cfg.get("num_nextn_predict_layers"):
        raise NotSupportedError("config.json num_nextn_predict_layers > 0 (multi-token prediction) is not supported")
    if cfg.get("mlp_hidden_act", "relu2") != "relu2":
        raise NotSupportedError(f"config.json mlp_hidden_act={cfg['mlp_hidden_act']!r} is not supported: use relu2")
    vocab = required(cfg, "vocab_size")
    heads = required(cfg, "num_attention_heads")
    out = dict(
        num_layers=len(pattern),
        hybrid_override_pattern=pattern,
        hidden_size=required(cfg, "hidden_size"),
        num_attention_heads=heads,
        num_query_groups=cfg.get("num_key_value_heads") or heads,
        kv_channels=cfg.get("head_dim") or required(cfg, "hidden_size") // heads,
        ffn_hidden_size=required(cfg, "intermediate_size"),
        activation_func=squared_relu,
        gated_linear_unit=False,
        add_bias_linear=False,
        seq_length=int(cfg.get("max_position_embeddings", 4096)),
        **_shared_fields(cfg, vocab),
        attention_dropout=float(cfg.get("attention_dropout", 0.0)),
        hidden_dropout=float(cfg.get("hidden_dropout", 0.0)),
        init_method_std=float(cfg.get("initializer_range", 0.02)),
        # transformers' Nemotron-H clamps softplus(dt) at time_step_min (its time_step_limit field is unused)
        mamba_dt_limit_min=float(cfg.get("time_step_min", 0.001)),
    )
    out.update(_mamba_mixer_fields(cfg, "mamba_num_heads", "mamba_head_dim", "ssm_state_size", "mamba_hidden_act",
                                   None))
    out.update(dtype_fields(cfg))
    return out


def nemotron_h_hf(p: Any) -> dict[str, Any]:
    pattern = "".join(allocate_layers(p.num_layers, p.hybrid_attention_ratio, p.hybrid_mlp_ratio,
                                      p.hybrid_override_pattern))
    if any(kind == "*" and window is not None for kind, window in zip(pattern, layer_windows(p))):
        raise NotSupportedError("Nemotron-H attention has no sliding window: export a model without window_size")
    if p.apply_residual_connection_post_layernorm and ("*" in pattern or "-" in pattern):
        raise NotSupportedError("Nemotron-H layers add to their input: export a model without "
                                "apply_residual_connection_post_layernorm")
    if "E" in pattern or p.normalization != "RMSNorm" or p.add_bias_linear or p.gated_linear_unit:
        raise NotSupportedError("Nemotron-H needs RMSNorm, no MoE layers, no linear biases and a plain MLP")
    if "-" in pattern and p.activation_func is not squared_relu:
        raise NotSupportedError("Nemotron-H's MLP layers use squared ReLU: set activation_func to squared_relu")
    if p.position_embedding_type != "none":
        raise NotSupportedError("Nemotron-H attention has no position embedding: set position_embedding_type='none'")
    mixer = _mamba_mixer_hf(p)
    heads = mixer.pop("heads")
    return dict(
        vocab_size=p.vocab_size, hidden_size=p.hidden_size, layers_block_type=[_NEMOTRON_H_TYPES[c] for c in pattern],
        num_attention_heads=p.num_attention_heads, num_key_value_heads=p.num_query_groups or p.num_attention_heads,
        head_dim=p.kv_channels or p.hidden_size // p.num_attention_heads, intermediate_size=p.ffn_hidden_size,
        mlp_hidden_act="relu2", max_position_embeddings=p.seq_length, mamba_num_heads=heads,
        mamba_head_dim=p.mamba_head_dim, ssm_state_size=p.mamba_state_dim, mamba_hidden_act="silu",
        time_step_min=float(p.mamba_dt_limit_min), mamba_proj_bias=False, attention_bias=False, mlp_bias=False,
        layer_norm_epsilon=p.layernorm_epsilon, residual_in_fp32=False,
        tie_word_embeddings=bool(p.share_embeddings_and_output_weights), attention_dropout=float(p.attention_dropout),
        hidden_dropout=float(p.hidden_dropout), initializer_range=float(p.init_method_std), **mixer,
    )
