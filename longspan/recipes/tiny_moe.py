"""``tiny-moe``: the ``tiny`` recipe with mixture-of-experts MLPs (4 experts, top-2, dropless).

Every layer's MLP becomes an MoE layer of 4 SwiGLU experts of width 128 (so two active experts cost half the
dense tiny's FFN), routed top-2 with softmax after top-k and a load-balancing aux loss (coefficient 1e-2).
4 experts divide by expert_model_parallel_size 2 and 4, and the expert width by tensor/expert tensor
parallel 2 and 4, so ``expert_model_parallel_size=2`` (with or without ``tensor_model_parallel_size=2``)
matches one process. Dropless (no capacity factor): the routed token set never depends on the layout.
"""

from __future__ import annotations

from longspan.recipes.tiny import tiny
from longspan.training.config import ConfigContainer

RUN_DIR = "runs/tiny-moe"


def tiny_moe() -> ConfigContainer:
    """``tiny`` with 4 experts per layer, top-2 routing, expert width 128, aux loss 1e-2, dropless."""
    cfg = tiny()
    model = cfg.model
    model.num_moe_experts = 4
    model.moe_router_topk = 2
    model.moe_ffn_hidden_size = 128
    model.moe_aux_loss_coeff = 1e-2
    model.moe_router_load_balancing_type = "aux_loss"
    model.moe_expert_capacity_factor = None
    model.moe_token_dispatcher_type = "alltoall"
    model.moe_grouped_gemm = True  # all local experts in one grouped GEMM per projection, as Bridge's MoE recipes
    cfg.logger.tensorboard_dir = f"{RUN_DIR}/tensorboard"
    cfg.checkpoint.save = f"{RUN_DIR}/checkpoints"
    cfg.checkpoint.load = f"{RUN_DIR}/checkpoints"
    return cfg
