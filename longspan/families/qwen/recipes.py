"""Qwen3 recipes: 8B and 0.6B pretraining with their real shapes."""

from __future__ import annotations

from longspan.recipes.real_sizes import pretrain_recipe, standard_decoder
from longspan.training.config import ConfigContainer


def qwen3_8b() -> ConfigContainer:
    """Qwen3 8B: 36 layers, hidden 4096, 32 heads / 8 KV groups of width 128, FFN 12288, QK-norm, rope 1e6."""
    model = standard_decoder(num_layers=36, hidden_size=4096, ffn_hidden_size=12288, num_attention_heads=32,
                             num_query_groups=8, kv_channels=128, qk_layernorm=True, seq_length=4096,
                             vocab_size=151936, rotary_base=1000000, layernorm_epsilon=1e-6)
    return pretrain_recipe(model, "qwen3_8b", "Qwen/Qwen3-8B", gbs=512, lr=3e-4, min_lr=3e-5, warmup_iters=500)


def qwen3_600m() -> ConfigContainer:
    """Qwen3 0.6B: 28 layers, hidden 1024, 16 heads / 8 KV groups of width 128, FFN 3072, tied embeddings."""
    model = standard_decoder(num_layers=28, hidden_size=1024, ffn_hidden_size=3072, num_attention_heads=16,
                             num_query_groups=8, kv_channels=128, qk_layernorm=True, seq_length=4096,
                             vocab_size=151936, rotary_base=1000000, layernorm_epsilon=1e-6,
                             share_embeddings_and_output_weights=True)
    return pretrain_recipe(model, "qwen3_600m", "Qwen/Qwen3-0.6B", gbs=256, lr=3e-4, min_lr=3e-5, warmup_iters=500)
