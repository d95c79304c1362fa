"""Gemma 4 recipes: ``gemma4``, the LoRA finetune of Gemma 4 E4B with its real shape (bf16, tied embeddings).

It is the ``lora`` recipe (``longspan.recipes.finetune``) on that model: the architecture, weights and tokenizer
come from ``checkpoint.pretrained_checkpoint`` (a Hugging Face directory of that model), the shape here lets
``longspan plan`` size the run without one. ``peft=null`` makes it a full finetune::

    longspan finetune --recipe gemma4 checkpoint.pretrained_checkpoint=gemma-4-E4B dataset.dataset_root=DATA
"""

from __future__ import annotations

from longspan.families.gemma4.provider import Gemma4ModelProvider
from longspan.models.activations import gelu_tanh
from longspan.recipes.finetune import SEQ_LENGTH
from longspan.recipes.real_sizes import lora_finetune
from longspan.training.config import ConfigContainer


def gemma4_e4b_model() -> Gemma4ModelProvider:
    """Gemma 4 E4B (google/gemma-4-E4B's text_config): 42 layers, hidden 2560, GeGLU FFN 10240, 8 heads over 2 KV
    groups, width 256 on the sliding-window layers (512 positions, RoPE base 10k) and 512 on every sixth, full
    layer (proportional RoPE on a quarter of it, base 1M); the last 18 layers reuse earlier keys and values;
    per-layer inputs of width 256 from their own 262144-row table; vocabulary 262144; logits soft-capped at 30."""
    return Gemma4ModelProvider(
        num_layers=42, hidden_size=2560, ffn_hidden_size=10_240, num_attention_heads=8, num_query_groups=2,
        kv_channels=256, global_kv_channels=512, softmax_scale=1.0, vocab_size=262_144,
        make_vocab_size_divisible_by=128, seq_length=SEQ_LENGTH, normalization="RMSNorm", layernorm_epsilon=1e-6,
        layernorm_after_sublayers=True, qk_layernorm=True, apply_embedding_scaling=True, gated_linear_unit=True,
        activation_func=gelu_tanh, add_bias_linear=False, position_embedding_type="rope",
        rotary_base=[10_000, 1_000_000], global_rotary_percent=0.25, rope_scaling_factor=1.0, window_size=[511, 0],
        window_attn_skip_freq=6, num_kv_shared_layers=18, per_layer_embed_dim=256,
        per_layer_embed_vocab_size=262_144, final_logit_softcapping=30.0, share_embeddings_and_output_weights=True,
        attention_dropout=0.0, hidden_dropout=0.0, bf16=True,
    )


def gemma4() -> ConfigContainer:
    """LoRA finetune of Gemma 4 E4B (checkpoint.pretrained_checkpoint = its HF directory; peft=null: full)."""
    return lora_finetune(gemma4_e4b_model(), "gemma4")
