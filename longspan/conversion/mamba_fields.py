"""The Mamba-2 mixer's config.json fields, shared by every HF architecture built of Mamba-2 mixers (pure Mamba-2
stacks and the hybrids): the mixer's own keys, the fused-segment sizes of its weight table and the stack-wide
fields (vocabulary, RMSNorm, no position embedding, tied embeddings). The key names that differ between the
architectures are passed in; the family's display name is passed in for error messages."""

from __future__ import annotations

from typing import Any

from longspan.conversion.config_fields import required, vocab_divisor
from longspan.core.errors import NotSupportedError


def mamba_mixer_fields(cfg: dict[str, Any], heads_key: str, head_dim_key: str, state_key: str, act_key: str,
                       limit: tuple[float, float] | None) -> dict[str, Any]:
    """MambaProvider fields of a Mamba-2 mixer's config.json keys (``limit``: the time_step_limit it needs)."""
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


def mixer_sizes(cfg: dict[str, Any], heads_key: str, head_dim_key: str, state_key: str) -> tuple[int, int, int]:
    """(d_inner, groups · state, heads): the sizes of the fused in_proj / conv1d segments (1s when absent)."""
    heads = int(cfg.get(heads_key) or 1)
    return heads * int(cfg.get(head_dim_key) or 1), int(cfg.get("n_groups", 8)) * int(cfg.get(state_key) or 1), heads


def mamba_mixer_hf(p: Any, family: str) -> dict[str, Any]:
    """The mixer's config.json keys for provider ``p``, plus ``heads`` (the caller writes it under its key)."""
    if p.layernorm_zero_centered_gamma:
        raise NotSupportedError(f"model.layernorm_zero_centered_gamma=True has no {family} config.json "
                                "form (its norms store gamma itself): export a model trained without it")
    heads = p.mamba_num_heads or p.mamba_expand * p.hidden_size // p.mamba_head_dim
    return dict(n_groups=p.mamba_num_groups, conv_kernel=p.mamba_conv_kernel, chunk_size=p.mamba_chunk_size,
                use_conv_bias=True, use_bias=False, heads=heads)


def mamba_stack_fields(cfg: dict[str, Any], vocab: int) -> dict[str, Any]:
    """What every Mamba-2 stack reads alike: vocabulary, RMSNorm, no position embedding, tied embeddings."""
    return dict(
        vocab_size=vocab,
        make_vocab_size_divisible_by=vocab_divisor(vocab),
        normalization="RMSNorm",
        layernorm_epsilon=float(cfg.get("layer_norm_epsilon", 1e-5)),
        position_embedding_type="none",
        share_embeddings_and_output_weights=bool(cfg.get("tie_word_embeddings", False)),
    )
