"""Qwen3.5 / Qwen3.6 recipes: a LoRA finetune of Qwen3.5 0.8B and of the Qwen3.6 35B-A3B mixture of experts,
with their real shapes (``checkpoint.pretrained_checkpoint`` names the HF directory; the shape lets
``longspan plan`` size the run without one)."""

from __future__ import annotations

import torch.nn.functional as F

from longspan.models.gpt_provider import GPTModelProvider
from longspan.peft import LoRA
from longspan.recipes.finetune import SEQ_LENGTH
from longspan.recipes.real_sizes import lora_finetune
from longspan.training.config import ConfigContainer


#: Megatron's LoRA targets with the gated DeltaNet layers' fused input and output projections
DELTANET_LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "in_proj", "out_proj")


def hybrid_model(**shape: object) -> GPTModelProvider:
    """The Qwen3.5 decoder: three gated DeltaNet layers to one gated-attention layer, (1 + w) RMSNorms, per-head
    QK-norm, RoPE on a quarter of each head (base 10M), SwiGLU, vocabulary 248320; ``shape`` sets the sizes."""
    fields = dict(
        vocab_size=248_320, make_vocab_size_divisible_by=128, seq_length=SEQ_LENGTH, normalization="RMSNorm",
        layernorm_epsilon=1e-6, layernorm_zero_centered_gamma=True, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, position_embedding_type="rope", rotary_base=10_000_000, rotary_percent=0.25,
        qk_layernorm=True, attention_output_gate=True, experimental_attention_variant="gated_delta_net",
        linear_attention_freq=4, linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
        attention_dropout=0.0, hidden_dropout=0.0, bf16=True,
    )
    fields.update(shape)
    return GPTModelProvider(**fields)  # type: ignore[arg-type]


def qwen35_800m_model() -> GPTModelProvider:
    """Qwen3.5 0.8B: 24 layers, hidden 1024, 8 heads / 2 KV groups of width 256, FFN 3584, 16 key and value
    heads in the DeltaNet layers, tied embeddings."""
    return hybrid_model(num_layers=24, hidden_size=1024, ffn_hidden_size=3584, num_attention_heads=8,
                        num_query_groups=2, kv_channels=256, linear_num_key_heads=16, linear_num_value_heads=16,
                        share_embeddings_and_output_weights=True)


def qwen36_35b_a3b_model() -> GPTModelProvider:
    """Qwen3.6 35B-A3B (Qwen3.5-MoE's architecture): 40 layers, hidden 2048, 16 heads / 2 KV groups of width 256,
    16 key / 32 value heads in the DeltaNet layers, 256 experts of width 512 (top 8) and a gated shared expert of
    width 512 on every layer, untied output layer."""
    return hybrid_model(num_layers=40, hidden_size=2048, ffn_hidden_size=512, num_attention_heads=16,
                        num_query_groups=2, kv_channels=256, linear_num_key_heads=16, linear_num_value_heads=32,
                        num_moe_experts=256, moe_router_topk=8, moe_ffn_hidden_size=512,
                        moe_shared_expert_intermediate_size=512, moe_shared_expert_gate=True,
                        moe_router_pre_softmax=False, moe_router_load_balancing_type="aux_loss",
                        moe_aux_loss_coeff=0.001, expert_model_parallel_size=8,
                        share_embeddings_and_output_weights=False)


def qwen35() -> ConfigContainer:
    """LoRA finetune of Qwen3.5 0.8B (checkpoint.pretrained_checkpoint = its HF directory; peft=null: full) on
    the attention projections and the gated DeltaNet ones (``in_proj``, ``out_proj``: three layers in four)."""
    cfg = lora_finetune(qwen35_800m_model(), "qwen35")
    cfg.peft = LoRA(target_modules=[*DELTANET_LORA_TARGETS])
    return cfg


def qwen36_moe_lora() -> ConfigContainer:
    """LoRA finetune of Qwen3.6 35B-A3B on the attention projections (q/k/v and output gate, output), the DeltaNet
    projections (Megatron's ``in_proj``: q/k/v/z/b/a, and ``out_proj``) and the experts (routed and shared),
    experts split over 8 ranks."""
    cfg = lora_finetune(qwen36_35b_a3b_model(), "qwen36_moe_lora")
    cfg.peft = LoRA(target_modules=[*DELTANET_LORA_TARGETS])
    return cfg
