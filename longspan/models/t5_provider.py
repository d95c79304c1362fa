"""``T5ModelProvider``: an encoder-decoder model's configuration; ``provide()`` builds ``longspan.models.t5.T5Model``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

from longspan.models.gpt_provider import ModelProviderMixin, TransformerConfig


@dataclass
class T5ModelProvider(ModelProviderMixin, TransformerConfig):
    """Megatron Bridge's T5 provider fields, with its defaults. ``num_layers`` is the decoder's depth.

    Values the T5 model does not implement (grouped-query attention, MoE, ...) raise a one-line
    NotSupportedError when the model is built. ``window_size=[left, right]`` is two-sided here: the encoder
    attends to ``left`` earlier and ``right`` later tokens, the causal decoder to ``left`` earlier ones, and
    cross-attention to the band bottom-right aligned on the encoder (Megatron's T5; ``longspan.models.t5``);
    ``window_attn_skip_freq`` counts each stack's layers on its own."""

    encoder_num_layers: Optional[int] = None
    """Encoder layers; None means num_layers (the decoder's depth)."""

    fp16_lm_cross_entropy: bool = False
    """Compute the output cross-entropy in fp16 instead of fp32."""

    parallel_output: bool = True
    """Keep the logits split across tensor-parallel ranks."""

    share_embeddings_and_output_weights: bool = True
    """Tie the output layer's weight to the input embedding."""

    scale_decoder_outputs: bool = False
    """Multiply the decoder output by hidden_size**-0.5 before the output layer, as HF T5 (v1.0, tied) does
    (a longspan addition, not a Megatron Bridge field; the T5 conversion sets it from config.json)."""

    make_vocab_size_divisible_by: int = 128
    """Pad the vocabulary up to a multiple of this."""

    position_embedding_type: Literal["learned_absolute", "rope", "relative"] = "learned_absolute"
    """Position information of the encoder and decoder: a learned absolute table shared by both, T5's
    relative position buckets (a learned bias per bucket and head, one table per stack), or rotary
    positions in every self-attention (base 10000; cross-attention is not rotated, as in Megatron's T5)."""

    apply_rope_fusion: bool = True
    """Use the fused RoPE kernel (a performance hint: longspan's rotation is plain PyTorch)."""

    max_position_embeddings: int = 512
    """Size of the learned position table (learned_absolute); must cover seq_length and seq_length_dec."""

    relative_attention_num_buckets: int = 32
    """Buckets of relative position attention (half per direction in the bidirectional encoder)."""

    relative_attention_max_distance: int = 128
    """Distance from which all offsets share the last (log-spaced) bucket."""

    rotary_percent: float = 1.0
    """Fraction of each head's channels that rotary embeddings rotate (position_embedding_type='rope')."""

    seq_len_interpolation_factor: Optional[float] = None
    """Linear position interpolation factor: rotary frequencies divided by it (rope only); None = off."""

    seq_length: int = 512
    """Encoder sequence length (must equal dataset.sequence_length)."""

    seq_length_dec: int = 128
    """Decoder sequence length (the T5 dataset's decoder length)."""

    encoder_pipeline_model_parallel_size: int = 0
    """With pipeline parallel: 0 splits the encoder layers followed by the decoder layers over the stages
    together (a stage may hold both); k > 0 gives the encoder layers to the first k of the
    pipeline_model_parallel_size stages and the decoder layers to the others."""

    vocab_size: Optional[int] = None
    """Vocabulary size before padding; None means it comes from the tokenizer."""

    tp_comm_overlap_cfg: Optional[Union[str, dict[str, Any]]] = None
    """TransformerEngine userbuffer configuration for tp_comm_overlap."""

    def build_model(self, pre_process: bool, post_process: bool, vp_stage: Optional[int],
                    layer_numbers: Optional[list[int]], materialize: bool) -> Any:
        """``longspan.models.t5.build_t5_model`` (see ``ModelProviderMixin``): the whole model, or a pipeline
        stage holding ``layer_numbers`` of the encoder layers followed by the decoder layers."""
        from longspan.models.t5 import build_t5_model  # keeps the providers (configs) free of the model code

        return build_t5_model(self, materialize=materialize, pre_process=pre_process, post_process=post_process,
                              layer_numbers=layer_numbers)
