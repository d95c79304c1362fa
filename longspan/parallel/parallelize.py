"""Turn a plain (meta-device) model into the distributed model the layout asks for.

Plans are applied from the outside (torchtitan's way): tensor/sequence parallel with DTensor plans, context
parallel, expert parallel, then data parallel (DDP or FSDP2). The model code never knows.
``longspan.training.setup`` calls ``parallelize_model`` on the meta model and ``init_weights`` afterwards, so
every layout draws the same full weights from the seed.
"""

from __future__ import annotations

from typing import Any

import torch

from longspan.core.errors import NotSupportedError
from longspan.core.logging import get_logger, warn_rank_0
from longspan.parallel.context_parallel import apply_context_parallel
from longspan.parallel.data_parallel import (
    DDP_MODE,
    DISTRIBUTED_OPTIMIZER_MODE,
    FSDP2_MODE,
    apply_ddp,
    apply_fsdp2,
    check_data_parallel_config,
    data_parallel_mesh,
    data_parallel_mode,
    mixed_precision_policy,
)
from longspan.parallel.expert_parallel import apply_expert_parallel, hidden_parameters, ignore_in_ddp
from longspan.parallel.loss_parallel import parallel_loss_context
from longspan.parallel.tensor_parallel import apply_tensor_parallel

__all__ = ["parallelize_model", "parallel_loss_context"]

_log = get_logger(__name__)


def parallelize_model(model: torch.nn.Module, cfg: Any, parallel: Any) -> torch.nn.Module:
    """Apply the parallel plans for ``cfg``'s layout to ``model`` (still on the meta device).

    Tensor (and sequence) parallel over the ``tp`` mesh dimension when ``model.tensor_model_parallel_size``
    > 1, context parallel over ``cp`` (``longspan.parallel.context_parallel``), then data parallel over ``dp``
    (× ``cp``) when it has more than one rank: DDP, FSDP2 or the distributed optimizer (see
    ``longspan.parallel.data_parallel``). Returns the model to train (a DDP wrapper, or ``model`` itself with
    DTensor parameters); call ``init_weights`` on it next.
    """
    if parallel.world_size == 1:
        return model
    if parallel.pp_size > 1:
        raise NotSupportedError(
            f"pipeline_model_parallel_size={parallel.pp_size} is not supported by this build's parallel plans"
        )
    check_data_parallel_config(cfg)
    tp = parallel.tp_size
    if tp > 1:
        apply_tensor_parallel(model, parallel.submesh("tp"), bool(getattr(cfg.model, "sequence_parallel", False)))
    if parallel.cp_size > 1:
        # After tensor parallel (its root hook makes the loss a plain tensor first), before data parallel.
        apply_context_parallel(model, parallel.cp_group)
    # MoE experts: sharded over ep/etp with all-to-all dispatch; the data-parallel wrappers leave them alone
    # (expert_parallel reduces their gradients itself).
    expert_params = apply_expert_parallel(model, parallel, bool(getattr(cfg.model, "sequence_parallel", False)))
    dp = parallel.dp_size * parallel.cp_size
    if dp == 1:
        return model
    mode = data_parallel_mode(cfg, tp)
    if mode == DDP_MODE and tp > 1:
        warn_rank_0(
            f"data parallel {parallel.dp_size} × tensor parallel {tp}: DDP does not take DTensor parameters, "
            "so FSDP2 with reshard_after_forward=False (DDP's maths, sharded optimizer state) is used"
        )
        mode = DISTRIBUTED_OPTIMIZER_MODE
    if mode == DDP_MODE:
        dtype = getattr(cfg.model, "params_dtype", None) or torch.float32
        ignore_in_ddp(model, expert_params)
        return apply_ddp(model, parallel.group("dp_cp" if parallel.cp_size > 1 else "dp"), parallel.device,
                         cfg.ddp, param_dtype=dtype)
    policy = mixed_precision_policy(cfg.model, cfg.ddp)
    with hidden_parameters(model, expert_params):
        return apply_fsdp2(model, data_parallel_mesh(parallel), mp_policy=policy,
                           reshard_after_forward=(mode == FSDP2_MODE),
                           prefetch=bool(getattr(cfg.ddp, "overlap_param_gather", False)))
