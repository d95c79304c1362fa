"""Tiny ``GPTModelProvider`` configs for the model tests."""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F

from longspan.models.gpt_provider import GPTModelProvider


def make_config(**overrides: Any) -> GPTModelProvider:
    """A tiny provider (2 layers, hidden 64, 4 heads, vocab 100) with the provider's defaults otherwise."""
    values: dict[str, Any] = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32,
                              "vocab_size": 100}
    values.update(overrides)
    cfg = GPTModelProvider(**values)
    if cfg.ffn_hidden_size is None:  # tests read it to build their oracles
        cfg.ffn_hidden_size = 4 * cfg.hidden_size
    return cfg


def llama_config(**overrides: Any) -> GPTModelProvider:
    """A tiny Llama-shaped provider: RMSNorm, RoPE, SwiGLU, GQA, no biases, untied, no dropout."""
    values: dict[str, Any] = dict(
        num_layers=2,
        hidden_size=64,
        ffn_hidden_size=96,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=128,
        make_vocab_size_divisible_by=128,
        normalization="RMSNorm",
        layernorm_epsilon=1e-5,
        activation_func=F.silu,
        gated_linear_unit=True,
        add_bias_linear=False,
        position_embedding_type="rope",
        rotary_base=10000,
        share_embeddings_and_output_weights=False,
        attention_dropout=0.0,
        hidden_dropout=0.0,
    )
    values.update(overrides)
    return make_config(**values)
