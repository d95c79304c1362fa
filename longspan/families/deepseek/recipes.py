"""``tiny-deepseek``: the ``tiny`` recipe shaped as DeepSeek-V3 (trains from random weights on a CPU).

- multi-latent attention with query compression: queries through a rank-64 latent, keys and values through a
  rank-32 latent plus one shared 8-channel rotary key (interleaved RoPE), latent RMSNorms (``qk_layernorm``);
- the first layer dense (the ``tiny`` SwiGLU MLP of 512), the other three DeepSeek MoE layers: 8 routed SwiGLU
  experts of width 128, sigmoid scores, top-2 chosen within the best of 2 expert groups, the chosen scores
  normalized and scaled by 2.5, plus one always-on shared expert of width 128;
- aux-loss-free load balancing: the routing bias (``router.expert_bias``) moves every step from the token
  counts (rate 1e-3), no auxiliary loss.
- multi-token prediction: one depth (``mtp_num_layers=1``, an MoE layer like the last decoder layer) predicts
  the token two places ahead; its loss joins the objective weighted 0.1 (``mtp_loss_scaling_factor``, Megatron
  Bridge's DeepSeek-V3 recipe) and is logged as ``mtp_1 loss``.

Eight experts divide by expert_model_parallel_size 2, 4 and 8; every setting has a DeepSeek-V3 HF equivalent
(``layernorm_epsilon`` 1e-6 as transformers' latent norms), so a trained checkpoint exports as
``DeepseekV3ForCausalLM``, its MTP depth as ``model.layers.4`` (``num_nextn_predict_layers=1``).
"""

from __future__ import annotations

from longspan.recipes.tiny import tiny
from longspan.training.config import ConfigContainer

RUN_DIR = "runs/tiny-deepseek"


def tiny_deepseek() -> ConfigContainer:
    """``tiny`` with MLA (q_lora_rank 64, kv_lora_rank 32), a dense first layer, then 8 routed + 1 shared
    expert per layer with DeepSeek-V3's group-limited sigmoid routing and the aux-loss-free expert bias, and one
    multi-token-prediction depth."""
    cfg = tiny()
    model = cfg.model
    model.num_query_groups = None  # MLA: every head its own key and value from the shared latent
    model.multi_latent_attention = True
    model.q_lora_rank = 64
    model.kv_lora_rank = 32
    model.qk_head_dim = 16
    model.qk_pos_emb_head_dim = 8
    model.v_head_dim = 16
    model.qk_layernorm = True
    model.layernorm_epsilon = 1e-6
    model.num_moe_experts = 8
    model.moe_router_topk = 2
    model.moe_ffn_hidden_size = 128
    model.moe_shared_expert_intermediate_size = 128
    model.moe_layer_freq = [0, 1, 1, 1]
    model.moe_router_score_function = "sigmoid"
    model.moe_router_num_groups = 2
    model.moe_router_group_topk = 1
    model.moe_router_topk_scaling_factor = 2.5
    model.moe_router_enable_expert_bias = True
    model.moe_router_bias_update_rate = 1e-3
    model.moe_router_dtype = "fp32"
    model.moe_router_load_balancing_type = "none"
    model.moe_aux_loss_coeff = 0.0
    model.moe_expert_capacity_factor = None
    model.moe_token_dispatcher_type = "alltoall"
    model.moe_grouped_gemm = True  # all local experts in one grouped GEMM per projection, as Bridge's MoE recipes
    model.mtp_num_layers = 1
    model.mtp_loss_scaling_factor = 0.1
    cfg.logger.tensorboard_dir = f"{RUN_DIR}/tensorboard"
    cfg.checkpoint.save = f"{RUN_DIR}/checkpoints"
    cfg.checkpoint.load = f"{RUN_DIR}/checkpoints"
    return cfg
