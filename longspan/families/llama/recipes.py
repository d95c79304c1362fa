"""Llama recipes: Llama-3 8B / 70B pretraining and Llama 3.2 1B / 3B LoRA finetunes, with their real shapes."""

from __future__ import annotations

import torch.nn.functional as F

from longspan.models.gpt_provider import GPTModelProvider
from longspan.recipes.finetune import SEQ_LENGTH
from longspan.recipes.real_sizes import lora_finetune, pretrain_recipe, standard_decoder
from longspan.training.config import ConfigContainer


def llama3_8b() -> ConfigContainer:
    """Llama-3 8B: 32 layers, hidden 4096, 32 heads / 8 KV groups, FFN 14336, 8k context, rope base 500000."""
    model = standard_decoder(num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
                         num_query_groups=8, kv_channels=128, seq_length=8192, vocab_size=128256,
                         rotary_base=500000)
    return pretrain_recipe(model, "llama3_8b", "meta-llama/Meta-Llama-3-8B", gbs=512, lr=3e-4, min_lr=3e-5)


def llama3_70b() -> ConfigContainer:
    """Llama-3 70B: 80 layers, hidden 8192, 64 heads / 8 KV groups, FFN 28672; tensor parallel 8 with SP."""
    model = standard_decoder(num_layers=80, hidden_size=8192, ffn_hidden_size=28672, num_attention_heads=64,
                         num_query_groups=8, kv_channels=128, seq_length=8192, vocab_size=128256,
                         rotary_base=500000, tensor_model_parallel_size=8, sequence_parallel=True)
    return pretrain_recipe(model, "llama3_70b", "meta-llama/Meta-Llama-3-70B", gbs=512, lr=1.5e-4, min_lr=1.5e-5)


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


def llama32() -> ConfigContainer:
    """LoRA finetune of Llama 3.2 1B (checkpoint.pretrained_checkpoint = its HF directory; peft=null: full)."""
    return lora_finetune(llama32_1b_model(), "llama32")


def llama32_3b() -> ConfigContainer:
    """LoRA finetune of Llama 3.2 3B (checkpoint.pretrained_checkpoint = its HF directory; peft=null: full)."""
    return lora_finetune(llama32_3b_model(), "llama32_3b")
