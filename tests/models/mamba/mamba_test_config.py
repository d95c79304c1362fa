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


def small_mamba_run(tmp_path: Any, recipe: str = "tiny-mamba", name: str = "run", dropout: float = 0.0,
                    **train_overrides: Any) -> Any:
    """The ``tiny-mamba`` / ``tiny-hybrid`` recipe shrunk to seconds: mock data, NullTokenizer, hidden 32,
    4 microbatches of 2 × 48 tokens (48 is not a multiple of the chunk 16), hidden/attention dropout."""
    from pathlib import Path

    from longspan.recipes import get_recipe
    from tests.training.pretrain_helpers import null_tokenizer_mock_data, small_run_settings

    cfg = get_recipe(recipe)
    model = cfg.model
    model.hidden_size = 32
    model.mamba_num_heads = 4
    model.mamba_head_dim = 16
    model.mamba_state_dim = 8
    model.mamba_chunk_size = 16
    model.num_attention_heads = 4
    model.num_query_groups = 2
    model.ffn_hidden_size = 64
    model.hidden_dropout = dropout
    model.attention_dropout = dropout
    null_tokenizer_mock_data(cfg, 48)
    return small_run_settings(cfg, Path(tmp_path) / name, 12, 6, 1, 2, train_overrides)
