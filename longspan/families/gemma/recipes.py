"""Gemma recipes: ``gemma3``, the LoRA finetune of Gemma 3 1B with its real shape (bf16, tied embeddings).

It is the ``lora`` recipe (``longspan.recipes.finetune``) on that model: the architecture, weights and tokenizer
come from ``checkpoint.pretrained_checkpoint`` (a Hugging Face directory of that model), the shape here lets
``longspan plan`` size the run without one. ``peft=null`` makes it a full finetune (``sft``'s learning rate is
5e-6)::

    longspan finetune --recipe gemma3 checkpoint.pretrained_checkpoint=gemma-3-1b-pt dataset.dataset_root=DATA
"""

from __future__ import annotations

import math

from longspan.models.activations import gelu_tanh
from longspan.models.gpt_provider import GPTModelProvider
from longspan.recipes.finetune import SEQ_LENGTH
from longspan.recipes.real_sizes import lora_finetune
from longspan.training.config import ConfigContainer


def gemma3_1b_model() -> GPTModelProvider:
    """Gemma 3 1B (google/gemma-3-1b-pt): 26 layers, hidden 1152, 4 heads / 1 KV group of width 256, GeGLU FFN
    6912, vocabulary 262144; five sliding-window layers (512 positions, RoPE base 10k) to one global layer (1M)."""
    return GPTModelProvider(
        num_layers=26, hidden_size=1152, ffn_hidden_size=6912, num_attention_heads=4, num_query_groups=1,
        kv_channels=256, softmax_scale=1 / math.sqrt(256), vocab_size=262_144, make_vocab_size_divisible_by=128,
        seq_length=SEQ_LENGTH, normalization="RMSNorm", layernorm_epsilon=1e-6, layernorm_zero_centered_gamma=True,
        layernorm_after_sublayers=True, qk_layernorm=True, apply_embedding_scaling=True, gated_linear_unit=True,
        activation_func=gelu_tanh, add_bias_linear=False, position_embedding_type="rope",
        rotary_base=[10_000, 1_000_000], rope_scaling_factor=1.0, window_size=[511, 0], window_attn_skip_freq=6,
        share_embeddings_and_output_weights=True, attention_dropout=0.0, hidden_dropout=0.0, bf16=True,
    )


def gemma3() -> ConfigContainer:
    """LoRA finetune of Gemma 3 1B (checkpoint.pretrained_checkpoint = its HF directory; peft=null: full)."""
    return lora_finetune(gemma3_1b_model(), "gemma3")
