"""Tiny ``MambaProvider`` configs for the Mamba tests."""

from __future__ import annotations

from typing import Any

from longspan.models.mamba_provider import MambaProvider


def mamba_config(**overrides: Any) -> MambaProvider:
    """A tiny pure-Mamba provider: 2 layers, hidden 32, 8 heads of 8 channels in 2 groups, state 8."""
    values: dict[str, Any] = dict(
        num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, mamba_num_groups=2,
        mamba_state_dim=8, mamba_head_dim=8, mamba_chunk_size=8, vocab_size=128, make_vocab_size_divisible_by=1,
        seq_length=32, init_method_std=0.02,
    )
    values.update(overrides)
    cfg = MambaProvider(**values)
    cfg.finalize()
    return cfg


def hybrid_config(**overrides: Any) -> MambaProvider:
    """A tiny hybrid: Mamba, attention, MLP, Mamba (``M*-M``), attention with 4 heads in 2 query groups."""
    values: dict[str, Any] = dict(num_layers=4, hybrid_override_pattern="M*-M", num_query_groups=2)
    values.update(overrides)
    return mamba_config(**values)
