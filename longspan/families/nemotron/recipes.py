"""``nemotron3-nano``: Megatron Bridge's ``nemotron_3_nano`` pretraining shape (Nemotron-3-Nano-30B-A3B), a
Mamba-2 / attention / mixture-of-experts hybrid, as a pretraining run (bf16, mock data unless a data path is
given; the shape lets ``longspan plan`` size it). ``nemotron3-nano-lora``: the LoRA finetune of that model
(Bridge's ``nemotron_3_nano_peft_config``), weights and tokenizer from ``checkpoint.pretrained_checkpoint``.

Parameters: 31,577,937,344 (the published "31.6B total parameters" of nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16,
its model card; from its config.json: vocabulary 131072 untied, hidden 2688, 23 Mamba layers of 64 heads × 64 in
8 groups with state 128, 6 attention layers of 32 heads / 2 KV groups of 128, 23 MoE layers of 128 experts of
width 1856 with a shared expert of width 3712):
2 · 131072 · 2688 (embedding, output) + 2688 (final norm) + 23 · 38,744,896 (Mamba) + 6 · 23,399,040 (attention)
+ 23 · 1,297,468,032 (MoE: router, 128 experts, shared expert, norm). Active per token: 3,580,073,408 (6 of 128
experts; the published "3.6B including embeddings").
"""

from __future__ import annotations

from longspan.models.activations import squared_relu
from longspan.models.mamba_provider import MambaProvider
from longspan.peft import LoRA
from longspan.recipes.finetune import SEQ_LENGTH, finetune_recipe
from longspan.recipes.real_sizes import pretrain_recipe
from longspan.training.config import ConfigContainer

#: Bridge's LoRA targets for the Nemotron-H / Nemotron 3 recipes: attention, MLPs and experts, the Mamba mixers
NEMOTRON_LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "in_proj", "out_proj")

#: Bridge's Nemotron3NanoProvider pattern: M = Mamba-2, E = MoE, * = attention
NANO_PATTERN = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"


def nemotron3_nano_model() -> MambaProvider:
    """Nemotron 3 Nano 30B-A3B (Bridge's ``Nemotron3NanoProvider`` on ``NemotronHModelProvider``'s defaults),
    sequence 8192 as Bridge's pretraining recipe. Layout: Bridge's expert parallel 8 with sequence parallel, but
    tensor parallel 2 where Bridge uses 4: longspan's attention splits whole key/value groups and Nano has 2.
    Expert tensor parallel is left to follow it (2, where Bridge sets 1): longspan's expert parallel needs the two
    equal, so the expert grid spans 2 x 8 = 16 ranks."""
    return MambaProvider(
        num_layers=len(NANO_PATTERN), hybrid_override_pattern=NANO_PATTERN, hidden_size=2688,
        mamba_num_heads=64, mamba_head_dim=64, mamba_num_groups=8, mamba_state_dim=128, mamba_chunk_size=128,
        mamba_conv_kernel=4, num_attention_heads=32, num_query_groups=2, kv_channels=128, ffn_hidden_size=1856,
        activation_func=squared_relu, gated_linear_unit=False, add_bias_linear=False, normalization="RMSNorm",
        layernorm_epsilon=1e-5, position_embedding_type="none", vocab_size=131072, make_vocab_size_divisible_by=128,
        share_embeddings_and_output_weights=False, seq_length=8192, init_method_std=0.0173,
        num_moe_experts=128, moe_router_topk=6, moe_ffn_hidden_size=1856, moe_shared_expert_intermediate_size=3712,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_dtype="fp32",
        moe_router_topk_scaling_factor=2.5, moe_router_num_groups=1, moe_router_group_topk=1,
        # Bridge balances with its per-sequence aux loss ('seq_aux_loss', 1e-4), which longspan does not have yet:
        # the batch-level 'aux_loss' at the same coefficient stands in
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-4, moe_grouped_gemm=True,
        tensor_model_parallel_size=2, sequence_parallel=True, expert_model_parallel_size=8, bf16=True,
    )


def nemotron3_nano() -> ConfigContainer:
    """Pretraining of Nemotron 3 Nano with Bridge's schedule: global batch 3072 in microbatches of 2, lr 1.6e-3
    cosine to 1.6e-5 after 333 warmup iterations, 39735 iterations, weight decay 0.1."""
    cfg = pretrain_recipe(nemotron3_nano_model(), "nemotron3-nano", "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16",
                          gbs=3072, lr=1.6e-3, min_lr=1.6e-5, warmup_iters=333, train_iters=39735)
    cfg.train.micro_batch_size = 2
    return cfg


def nemotron3_nano_lora() -> ConfigContainer:
    """LoRA finetune of Nemotron 3 Nano (checkpoint.pretrained_checkpoint = its HF directory; peft=null: full) as
    Bridge's PEFT recipe: sequence 2048, no tensor parallel, expert parallel 8, rank 32 / alpha 32, lr 1e-4 (bf16).
    Adapters go on Bridge's targets: attention, the dense MLPs, the shared experts, each routed expert and the
    Mamba-2 mixers' ``in_proj`` (one A over its z/x/B/C/dt segments) and ``out_proj``."""
    model = nemotron3_nano_model()
    model.seq_length = SEQ_LENGTH
    model.tensor_model_parallel_size = 1
    model.sequence_parallel = False
    cfg = finetune_recipe("nemotron3_nano_lora", lr=1e-4)
    cfg.model = model
    cfg.peft = LoRA(target_modules=list(NEMOTRON_LORA_TARGETS))
    cfg.mixed_precision = "bf16_mixed"
    return cfg
