"""Gemma 4 recipes: ``gemma4``, the LoRA finetune of Gemma 4 E4B, and ``gemma4-moe-lora``, that of Gemma 4
26B-A4B (the MoE block), each with its real shape (bf16, tied embeddings).

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


def gemma4_26b_a4b_model() -> Gemma4ModelProvider:
    """Gemma 4 26B-A4B (google/gemma-4-26B-A4B's text_config): 30 layers, hidden 2816, GeGLU FFN 2112 beside 128
    experts of width 704 (top 8) on every layer, 16 heads over 8 KV groups of width 256 on the sliding-window
    layers (1024 positions, RoPE base 10k) and 2 KV groups of width 512, keys as values, on every sixth, full
    layer (proportional RoPE on a quarter of it, base 1M); no KV sharing, no per-layer inputs; vocabulary 262144;
    logits soft-capped at 30. Parameters: 25,233,141,760 (transformers' Gemma4ForCausalLM for those
    config.json values, tied embeddings once; 3,822,530,560 active per token); the name's 26B also counts the
    vision encoder. Experts split over 8 ranks."""
    return Gemma4ModelProvider(
        num_layers=30, hidden_size=2816, ffn_hidden_size=2112, num_attention_heads=16, num_query_groups=8,
        kv_channels=256, global_kv_channels=512, num_global_query_groups=2, attention_k_eq_v=True, softmax_scale=1.0,
        vocab_size=262_144, make_vocab_size_divisible_by=128, seq_length=SEQ_LENGTH, normalization="RMSNorm",
        layernorm_epsilon=1e-6, layernorm_after_sublayers=True, qk_layernorm=True, apply_embedding_scaling=True,
        gated_linear_unit=True, activation_func=gelu_tanh, add_bias_linear=False, position_embedding_type="rope",
        rotary_base=[10_000, 1_000_000], global_rotary_percent=0.25, rope_scaling_factor=1.0, window_size=[1023, 0],
        window_attn_skip_freq=6, num_moe_experts=128, moe_router_topk=8, moe_ffn_hidden_size=704, moe_layer_freq=1,
        moe_router_pre_softmax=False, moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        moe_grouped_gemm=True, expert_model_parallel_size=8, final_logit_softcapping=30.0,
        share_embeddings_and_output_weights=True, attention_dropout=0.0, hidden_dropout=0.0, bf16=True,
    )


def gemma4() -> ConfigContainer:
    """LoRA finetune of Gemma 4 E4B (checkpoint.pretrained_checkpoint = its HF directory; peft=null: full)."""
    return lora_finetune(gemma4_e4b_model(), "gemma4")


def gemma4_moe_lora() -> ConfigContainer:
    """LoRA finetune of Gemma 4 26B-A4B (checkpoint.pretrained_checkpoint = its HF directory; peft=null: full),
    experts split over 8 ranks."""
    return lora_finetune(gemma4_26b_a4b_model(), "gemma4_moe_lora")
