"""MiniMax-M2 recipe: a LoRA finetune of MiniMax-M2 (230B total, 10B active per token) with its real shape
(``checkpoint.pretrained_checkpoint`` names the HF directory; the shape lets ``longspan plan`` size the run
without one).

The shape is the published config.json of MiniMaxAI/MiniMax-M2 (also M2.5 / M2.7, the same architecture), as
transformers' ``MiniMaxM2Config`` defaults repeat it: hidden 3072, 62 layers, 48 heads over 8 KV groups of width
128 with RoPE on 64 channels (``rotary_dim``, base 5M), 256 experts of width 1536 (top 8, sigmoid scores with
the expert bias) on every layer, vocabulary 200064, untied output layer. Megatron Bridge ships no MiniMax-M2
recipe (its MiniMax recipes are M3's); the layout follows its M2 example's advice (experts split over 16 ranks:
tensor parallel does not shrink the experts).
"""

from __future__ import annotations

from longspan.models.gpt_provider import GPTModelProvider
from longspan.peft import LoRA
from longspan.recipes.finetune import SEQ_LENGTH
from longspan.recipes.real_sizes import lora_finetune, standard_decoder
from longspan.training.config import ConfigContainer


def minimax_m2_model() -> GPTModelProvider:
    """MiniMax-M2 at its published size (bf16)."""
    return standard_decoder(
        num_layers=62, hidden_size=3072, ffn_hidden_size=1536, num_attention_heads=48, num_query_groups=8,
        kv_channels=128, vocab_size=200_064, seq_length=SEQ_LENGTH, layernorm_epsilon=1e-6,
        rotary_base=5_000_000, rotary_percent=0.5, qk_layernorm=True, qk_layernorm_across_heads=True,
        num_moe_experts=256, moe_router_topk=8, moe_ffn_hidden_size=1536, moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True, moe_router_pre_softmax=False,
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.001, expert_model_parallel_size=16,
        bf16=True,
    )


def minimax_m2() -> ConfigContainer:
    """LoRA finetune of MiniMax-M2 on the attention projections (q/k/v, output) and every routed expert, the
    experts split over 16 ranks."""
    cfg = lora_finetune(minimax_m2_model(), "minimax_m2")
    cfg.peft = LoRA(target_modules=["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])
    # one sample per data-parallel rank of the smallest layout the experts allow (16 ranks)
    cfg.train.global_batch_size = 16
    return cfg
