"""``MambaProvider``: a Mamba / hybrid model's configuration (fields now; the model is a later issue)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from longspan.core.errors import NotSupportedError
from longspan.models.gpt_provider import TransformerConfig


@dataclass
class MambaProvider(TransformerConfig):
    """Megatron Bridge's Mamba provider fields, with its defaults. ``provide()`` is not implemented yet."""

    fp16_lm_cross_entropy: bool = False
    """Compute the output cross-entropy in fp16 instead of fp32."""

    parallel_output: bool = True
    """Keep the logits split across tensor-parallel ranks."""

    share_embeddings_and_output_weights: bool = False
    """Tie the output layer's weight to the input embedding."""

    num_layers: int = 2
    """Number of layers (Mamba, attention and MLP layers together)."""

    num_attention_heads: int = 1
    """Attention heads of the hybrid attention layers."""

    mamba_num_groups: int = 8
    """Groups of the Mamba state-space layers."""

    mamba_state_dim: int = 128
    """State dimension of the Mamba layers."""

    mamba_head_dim: int = 64
    """Head dimension of the Mamba layers."""

    mamba_num_heads: Optional[int] = None
    """Heads of the Mamba layers; None derives it from the hidden size."""

    hybrid_attention_ratio: float = 0.0
    """Fraction of layers that are attention layers."""

    hybrid_mlp_ratio: float = 0.0
    """Fraction of layers that are MLP layers."""

    hybrid_override_pattern: Optional[str] = None
    """Explicit layer pattern (M = Mamba, * = attention, - = MLP)."""

    seq_length: int = 8192
    """Sequence length."""

    position_embedding_type: Literal["learned_absolute", "rope", "none"] = "none"
    """Position information (Mamba layers need none)."""

    rotary_percent: float = 1.0
    """Fraction of each head's channels that rotary embeddings rotate."""

    rotary_base: int = 10000
    """Base of the rotary embedding frequencies."""

    seq_len_interpolation_factor: Optional[float] = None
    """Linear position interpolation factor; None = off."""

    apply_rope_fusion: bool = True
    """Use the fused RoPE kernel."""

    make_vocab_size_divisible_by: int = 128
    """Pad the vocabulary up to a multiple of this."""

    gated_linear_unit: bool = False
    """Use a gated MLP."""

    normalization: Literal["LayerNorm", "RMSNorm"] = "RMSNorm"
    """Normalization layer type."""

    add_bias_linear: bool = False
    """Give the linear layers a bias."""

    hidden_dropout: float = 0.0
    """Dropout after layer outputs."""

    attention_dropout: float = 0.0
    """Dropout on attention weights."""

    layernorm_epsilon: float = 1e-5
    """Epsilon of the normalization layers."""

    vocab_size: Optional[int] = None
    """Vocabulary size before padding; None means it comes from the tokenizer."""

    def finalize(self) -> None:
        """Nothing to derive yet."""

    def provide(self, pre_process: bool = True, post_process: bool = True, vp_stage: Optional[int] = None):
        """Not implemented yet: Mamba models arrive in a later version of longspan."""
        raise NotSupportedError("model=MambaProvider is not supported yet by longspan (supported: GPTModelProvider)")
