"""Tiny GPT configs for the model tests.

Uses ``longspan.models.gpt_provider.GPTModelProvider`` when it exists; until then a local dataclass with the
same TransformerConfig field names and Megatron's defaults.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.nn.functional as F

try:  # the real provider, once it has landed
    from longspan.models.gpt_provider import GPTModelProvider as _Provider
except ImportError:  # pragma: no cover - depends on the other engineer's progress
    _Provider = None


@dataclasses.dataclass
class LocalGPTConfig:
    """Stand-in for GPTModelProvider with the fields the model reads (Megatron defaults)."""

    num_layers: int = 2
    hidden_size: int = 64
    ffn_hidden_size: int | None = None
    num_attention_heads: int = 4
    num_query_groups: int | None = None
    kv_channels: int | None = None
    seq_length: int = 32
    vocab_size: int = 100
    make_vocab_size_divisible_by: int = 128
    normalization: str = "LayerNorm"
    layernorm_epsilon: float = 1e-5
    activation_func: Callable = F.gelu
    gated_linear_unit: bool = False
    add_bias_linear: bool = True
    add_qkv_bias: bool = False
    position_embedding_type: str = "learned_absolute"
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0
    rope_scaling: bool = False
    rope_scaling_factor: float = 8.0
    share_embeddings_and_output_weights: bool = True
    attention_dropout: float = 0.1
    hidden_dropout: float = 0.1
    init_method_std: float = 0.02
    qk_layernorm: bool = False
    params_dtype: torch.dtype = torch.float32
    deterministic_mode: bool = False
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    perform_initialization: bool = True
    use_cpu_initialization: bool = False

    def __post_init__(self) -> None:
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size

    @property
    def padded_vocab_size(self) -> int:
        m = self.make_vocab_size_divisible_by
        return ((self.vocab_size + m - 1) // m) * m


def make_config(**overrides: Any) -> Any:
    """A tiny config; the real GPTModelProvider when available."""
    if _Provider is not None:
        defaults = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32, "vocab_size": 100}
        defaults.update(overrides)
        cfg = _Provider(**defaults)
        if getattr(cfg, "ffn_hidden_size", None) is None:
            cfg.ffn_hidden_size = 4 * cfg.hidden_size
        return cfg
    return LocalGPTConfig(**overrides)


def llama_config(**overrides: Any) -> Any:
    """A tiny Llama-shaped config: RMSNorm, RoPE, SwiGLU, GQA, no biases, untied, no dropout."""
    values = dict(
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
        rotary_base=10000.0,
        share_embeddings_and_output_weights=False,
        attention_dropout=0.0,
        hidden_dropout=0.0,
    )
    values.update(overrides)
    return make_config(**values)
