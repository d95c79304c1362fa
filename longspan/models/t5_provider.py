"""``T5ModelProvider``: an encoder-decoder model's configuration (fields now; the model is a later issue)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

from longspan.core.errors import NotSupportedError
from longspan.models.gpt_provider import TransformerConfig


@dataclass
class T5ModelProvider(TransformerConfig):
    """Megatron Bridge's T5 provider fields, with its defaults. ``provide()`` is not implemented yet."""

    encoder_num_layers: Optional[int] = None
    """Encoder layers; None means num_layers."""

    fp16_lm_cross_entropy: bool = False
    """Compute the output cross-entropy in fp16 instead of fp32."""

    parallel_output: bool = True
    """Keep the logits split across tensor-parallel ranks."""

    share_embeddings_and_output_weights: bool = True
    """Tie the output layer's weight to the input embedding."""

    make_vocab_size_divisible_by: int = 128
    """Pad the vocabulary up to a multiple of this."""

    position_embedding_type: Literal["learned_absolute", "rope", "relative"] = "learned_absolute"
    """Position information of the encoder and decoder."""

    apply_rope_fusion: bool = True
    """Use the fused RoPE kernel."""

    max_position_embeddings: int = 512
    """Size of the learned position table."""

    relative_attention_num_buckets: int = 32
    """Buckets of relative position attention."""

    relative_attention_max_distance: int = 128
    """Largest distance relative position attention distinguishes."""

    rotary_percent: float = 1.0
    """Fraction of each head's channels that rotary embeddings rotate."""

    seq_len_interpolation_factor: Optional[float] = None
    """Linear position interpolation factor; None = off."""

    seq_length: int = 512
    """Encoder sequence length."""

    seq_length_dec: int = 128
    """Decoder sequence length."""

    encoder_pipeline_model_parallel_size: int = 0
    """Pipeline stages reserved for the encoder."""

    vocab_size: Optional[int] = None
    """Vocabulary size before padding; None means it comes from the tokenizer."""

    tp_comm_overlap_cfg: Optional[Union[str, dict[str, Any]]] = None
    """TransformerEngine userbuffer configuration for tp_comm_overlap."""

    def finalize(self) -> None:
        """Fill derived Nones as Megatron Core does."""
        if self.ffn_hidden_size is None and self.hidden_size:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.num_query_groups is None and self.num_attention_heads:
            self.num_query_groups = self.num_attention_heads
        if self.kv_channels is None and self.num_attention_heads and self.hidden_size:
            self.kv_channels = self.hidden_size // self.num_attention_heads

    def provide(self, pre_process: bool = True, post_process: bool = True, vp_stage: Optional[int] = None) -> Any:
        """Not implemented yet: T5 models arrive in a later version of longspan."""
        raise NotSupportedError("model=T5ModelProvider is not supported yet by longspan (supported: GPTModelProvider)")
