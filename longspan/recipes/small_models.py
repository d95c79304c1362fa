"""Finetuning recipes for the small dense models people finetune today, with their real shapes (bf16):
``gemma3`` (Gemma 3 1B), ``llama32`` (Llama 3.2 1B) and ``llama32_3b`` (Llama 3.2 3B), tied embeddings all.

Each is the ``lora`` recipe (``longspan.recipes.finetune``) on that model: the architecture, weights and
tokenizer come from ``checkpoint.pretrained_checkpoint`` (a Hugging Face directory of that model), the shape
here lets ``longspan plan`` size the run without one. ``peft=null`` makes it a full finetune (``sft``'s
learning rate is 5e-6)::

    longspan finetune --recipe gemma3 checkpoint.pretrained_checkpoint=gemma-3-1b-pt dataset.dataset_root=DATA
"""

from __future__ import annotations

import math

import torch.nn.functional as F

from longspan.models.activations import gelu_tanh
from longspan.models.gpt_provider import GPTModelProvider
from longspan.peft import LoRA
from longspan.recipes.finetune import SEQ_LENGTH, finetune_recipe
from longspan.training.config import ConfigContainer


def _lora_on(model: GPTModelProvider, name: str) -> ConfigContainer:
    cfg = finetune_recipe(name, lr=1e-4)
    cfg.model = model
    cfg.peft = LoRA()
    cfg.mixed_precision = "bf16_mixed"
    return cfg


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


def _llama32_model(**shape: object) -> GPTModelProvider:
    """Llama 3.2: SwiGLU, RMSNorm, RoPE base 500000 with Llama-3 scaling (factor 32), vocabulary 128256, tied."""
    fields = dict(
        vocab_size=128_256, make_vocab_size_divisible_by=128, seq_length=SEQ_LENGTH, normalization="RMSNorm",
        layernorm_epsilon=1e-5, gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        position_embedding_type="rope", rotary_base=500_000, rope_scaling=True, rope_scaling_factor=32.0,
        low_freq_factor=1.0, high_freq_factor=4.0, old_context_len=8192, share_embeddings_and_output_weights=True,
        attention_dropout=0.0, hidden_dropout=0.0, bf16=True,
    )
    fields.update(shape)
    return GPTModelProvider(**fields)  # type: ignore[arg-type]


def llama32_1b_model() -> GPTModelProvider:
    """Llama 3.2 1B: 16 layers, hidden 2048, 32 heads / 8 KV groups of width 64, FFN 8192."""
    return _llama32_model(num_layers=16, hidden_size=2048, ffn_hidden_size=8192, num_attention_heads=32,
                          num_query_groups=8, kv_channels=64)


def llama32_3b_model() -> GPTModelProvider:
    """Llama 3.2 3B: 28 layers, hidden 3072, 24 heads / 8 KV groups of width 128, FFN 8192."""
    return _llama32_model(num_layers=28, hidden_size=3072, ffn_hidden_size=8192, num_attention_heads=24,
                          num_query_groups=8, kv_channels=128)


def gemma3() -> ConfigContainer:
    """LoRA finetune of Gemma 3 1B (checkpoint.pretrained_checkpoint = its HF directory; peft=null: full)."""
    return _lora_on(gemma3_1b_model(), "gemma3")


def llama32() -> ConfigContainer:
    """LoRA finetune of Llama 3.2 1B (checkpoint.pretrained_checkpoint = its HF directory; peft=null: full)."""
    return _lora_on(llama32_1b_model(), "llama32")


def llama32_3b() -> ConfigContainer:
    """LoRA finetune of Llama 3.2 3B (checkpoint.pretrained_checkpoint = its HF directory; peft=null: full)."""
    return _lora_on(llama32_3b_model(), "llama32_3b")
