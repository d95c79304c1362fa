"""``MambaProvider``: a Mamba-2 / hybrid Mamba–attention model's configuration; ``provide()`` builds
``longspan.models.mamba.MambaModel``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Optional

from longspan.models.gpt_provider import ModelProviderMixin, TransformerConfig


@dataclass
class MambaProvider(ModelProviderMixin, TransformerConfig):
    """Megatron Bridge's Mamba provider fields, with its defaults (plus three MambaMixer arguments Megatron
    hard-codes: ``mamba_chunk_size``, ``mamba_conv_kernel``, ``mamba_expand``).

    Layers come from ``hybrid_override_pattern`` (or the hybrid ratios): ``M`` Mamba-2 mixer, ``*`` attention,
    ``-`` MLP, ``E`` MoE. Attention / MLP layers read the usual TransformerConfig fields; ``window_attn_skip_freq``
    counts every layer of the stack (Megatron's numbering), and ``apply_residual_connection_post_layernorm``
    changes the attention / MLP layers only (Mamba layers always add to their input)."""

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
    """Explicit layer pattern, one symbol per layer (M = Mamba, * = attention, - = MLP, E = MoE); when set it
    must have num_layers symbols and overrides the ratios."""

    mamba_chunk_size: int = 128
    """Chunk length of the chunked SSD scan in training (Megatron MambaMixer's chunk_size); it changes
    speed and memory, not the result beyond rounding."""

    mamba_conv_kernel: int = 4
    """Width of the causal depthwise convolution before the scan (MambaMixer's d_conv)."""

    mamba_expand: int = 2
    """d_inner = mamba_expand × hidden_size when mamba_num_heads is None (MambaMixer's expand)."""

    mamba_dt_limit_min: float = 0.0
    """Clamp softplus(dt) from below at this value in the forward (Hugging Face Nemotron-H clamps at its
    time_step_min); 0.0 = no clamp, as Megatron's MambaMixer."""

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

    def build_model(self, pre_process: bool, post_process: bool, vp_stage: Optional[int],
                    layer_numbers: Optional[list[int]], materialize: bool) -> Any:
        """``longspan.models.mamba.build_mamba_model`` (see ``ModelProviderMixin``)."""
        from longspan.models.mamba import build_mamba_model  # keeps the providers (configs) free of the model code

        return build_mamba_model(self, pre_process, post_process, vp_stage, materialize=materialize,
                                 layer_numbers=layer_numbers)
