"""Qwen3-Next recipe: 80B-A3B pretraining with Megatron Bridge's shape and layout (pipeline 4, experts over 8)."""

from __future__ import annotations

from longspan.families.qwen35.recipes import hybrid_model
from longspan.recipes.real_sizes import pretrain_recipe
from longspan.training.config import ConfigContainer


def qwen3_next_80b_a3b() -> ConfigContainer:
    """Qwen3-Next 80B-A3B: 48 layers, hidden 2048, 16 heads / 2 KV groups of width 256, 16 key / 32 value heads
    in the DeltaNet layers, 512 experts of width 512 (top 10) and a gated shared expert of width 512 on every
    layer, vocabulary 151936, untied output layer; sequence 4096, selective recompute (Bridge's; its multi-token prediction layer
    is left out)."""
    model = hybrid_model(num_layers=48, hidden_size=2048, ffn_hidden_size=5120, num_attention_heads=16,
                         num_query_groups=2, kv_channels=256, linear_num_key_heads=16, linear_num_value_heads=32,
                         vocab_size=151_936, seq_length=4096, num_moe_experts=512, moe_router_topk=10,
                         moe_ffn_hidden_size=512, moe_shared_expert_intermediate_size=512,
                         moe_shared_expert_gate=True, moe_router_pre_softmax=False,
                         moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.001,
                         pipeline_model_parallel_size=4, expert_model_parallel_size=8,
                         recompute_granularity="selective", init_method_std=0.02,
                         share_embeddings_and_output_weights=False)
    return pretrain_recipe(model, "qwen3_next_80b_a3b", "Qwen/Qwen3-Next-80B-A3B-Instruct", gbs=512, lr=3e-4,
                           min_lr=3e-5, warmup_iters=500)
