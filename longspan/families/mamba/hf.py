"""Mamba-2 (``Mamba2ForCausalLM``): a stack of Mamba-2 mixers, as config.json and weights."""

from __future__ import annotations

from typing import Any

from longspan.conversion.config_fields import dtype_fields, required
from longspan.conversion.families import Family
from longspan.conversion.mamba_fields import mamba_mixer_fields, mamba_mixer_hf, mamba_stack_fields, mixer_sizes
from longspan.conversion.mapping import WeightMap, mamba_mixer
from longspan.core.errors import ConfigError, NotSupportedError
from longspan.models.mamba_provider import MambaProvider


def mamba2(d_inner: int, bc_rows: int, heads: int) -> tuple[WeightMap, ...]:
    """Mamba-2's weight table for a mixer of these sizes (``bc_rows = groups · state``)."""
    return (
        WeightMap("embedding.word_embeddings.weight", "backbone.embeddings.weight", vocab=True),
        WeightMap("decoder.final_norm.weight", "backbone.norm_f.weight"),
        WeightMap("output_layer.weight", "lm_head.weight", vocab=True),
        WeightMap("decoder.layers.{i}.norm.weight", "backbone.layers.{i}.norm.weight"),
        *mamba_mixer("decoder.layers.{i}.mixer", "backbone.layers.{i}.mixer", d_inner, bc_rows, heads),
    )


def mamba2_weights(cfg: dict[str, Any]) -> tuple[WeightMap, ...]:
    """Mamba-2's table for config.json ``cfg``: the fused in_proj / conv1d split by its mixer sizes."""
    return mamba2(*mixer_sizes(cfg, "num_heads", "head_dim", "state_size"))


def mamba2_provider(cfg: dict[str, Any]) -> dict[str, Any]:
    """MambaProvider keyword arguments of a Mamba-2 config.json."""
    layers = required(cfg, "num_hidden_layers")
    vocab = required(cfg, "vocab_size")
    if cfg.get("hidden_size", 0) * cfg.get("expand", 2) != cfg.get("num_heads", 0) * cfg.get("head_dim", 0):
        raise ConfigError("config.json hidden_size × expand must equal num_heads × head_dim (transformers' own rule)")
    out = dict(
        num_layers=layers,
        hybrid_override_pattern="M" * layers,
        hidden_size=required(cfg, "hidden_size"),
        mamba_expand=int(cfg.get("expand", 2)),
        **mamba_stack_fields(cfg, vocab),
        hidden_dropout=0.0,
        init_method_std=float(cfg.get("initializer_range", 0.1)),
    )
    out.update(mamba_mixer_fields(cfg, "num_heads", "head_dim", "state_size", "hidden_act", (0.0, float("inf"))))
    out.update(dtype_fields(cfg))
    return out


def mamba2_hf(p: Any) -> dict[str, Any]:
    """A Mamba-2 config.json body for provider ``p`` (Mamba layers only)."""
    pattern = p.hybrid_override_pattern
    if (pattern is not None and set(pattern) != {"M"}) or p.hybrid_attention_ratio or p.hybrid_mlp_ratio:
        raise NotSupportedError("Mamba2ForCausalLM has Mamba layers only: export a hybrid model as a hybrid "
                                "architecture")
    if p.normalization != "RMSNorm":
        raise NotSupportedError("Mamba2ForCausalLM needs normalization='RMSNorm'")
    mixer = mamba_mixer_hf(p, "Mamba-2")
    heads = mixer.pop("heads")
    if heads * p.mamba_head_dim % p.hidden_size:
        raise NotSupportedError("Mamba2ForCausalLM needs d_inner (heads × head_dim) to be a multiple of hidden_size")
    return dict(
        vocab_size=p.vocab_size, hidden_size=p.hidden_size, num_hidden_layers=p.num_layers, num_heads=heads,
        head_dim=p.mamba_head_dim, state_size=p.mamba_state_dim, expand=heads * p.mamba_head_dim // p.hidden_size,
        layer_norm_epsilon=p.layernorm_epsilon, hidden_act="silu", residual_in_fp32=True,
        initializer_range=float(p.init_method_std), tie_word_embeddings=bool(p.share_embeddings_and_output_weights),
        **mixer,
    )


MAMBA2 = Family("mamba2", "Mamba2ForCausalLM", "mamba2", mamba2(1, 1, 1), mamba2_provider, mamba2_hf,
                MambaProvider, mamba2_weights)
