"""Turn a plain (meta-device) model into the distributed model the layout asks for.

Plans are applied from the outside (torchtitan's way): tensor/sequence parallel with DTensor plans, context
parallel, expert parallel, then data parallel (DDP or FSDP2). The model code never knows.
``materialize_parallel_model`` is the one step from a meta model to the model to train, shared by the
whole-model path (``longspan.training.setup.build_model``) and each pipeline chunk
(``longspan.parallel.pipeline.build_pipeline_chunks``): hook (adapters) → FP8 linears → ``parallelize_model``
→ materialize, so every layout draws the same full weights from the seed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

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
from longspan.models.init import materialize_model
from longspan.parallel.expert_parallel import apply_expert_parallel, hidden_parameters, ignore_in_ddp
from longspan.parallel.float8 import apply_float8
from longspan.parallel.loss_parallel import parallel_loss_context
from longspan.parallel.t5 import apply_t5_context_parallel, is_t5_model
from longspan.parallel.tensor_parallel import apply_tensor_parallel

if TYPE_CHECKING:
    from longspan.config.schema.container import ConfigContainer

__all__ = ["materialize_parallel_model", "parallelize_model", "parallel_loss_context"]

_log = get_logger(__name__)


def parallelize_model(model: torch.nn.Module, cfg: ConfigContainer, parallel: Any) -> torch.nn.Module:
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
        apply_tensor_parallel(model, parallel.submesh("tp"), bool(cfg.model.sequence_parallel))
    if parallel.cp_size > 1:
        # After tensor parallel (its root hook makes the loss a plain tensor first), before data parallel.
        if is_t5_model(model):
            apply_t5_context_parallel(model, parallel.cp_group)
        else:
            apply_context_parallel(model, parallel.cp_group)
    # MoE experts: sharded over ep/etp with all-to-all dispatch; the data-parallel wrappers leave them alone
    # (expert_parallel reduces their gradients itself).
    expert_params = apply_expert_parallel(model, parallel, bool(cfg.model.sequence_parallel))
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
        dtype = cfg.model.params_dtype or torch.float32
        ignore_in_ddp(model, expert_params)
        return apply_ddp(model, parallel.group("dp_cp" if parallel.cp_size > 1 else "dp"), parallel.device,
                         cfg.ddp, param_dtype=dtype)
    policy = mixed_precision_policy(cfg.model, cfg.ddp)
    # QLoRA: frozen base weights that become NF4 after loading stay out of fully_shard (every rank keeps its
    # whole 4-bit copy; see longspan.peft.qlora). Marked by the adapters, read by name: no peft import here.
    quantized_base = [m.weight for m in model.modules() if getattr(m, "base_quantization", None) is not None]
    with hidden_parameters(model, expert_params + quantized_base):
        return apply_fsdp2(model, data_parallel_mesh(parallel), mp_policy=policy,
                           reshard_after_forward=(mode == FSDP2_MODE),
                           prefetch=bool(cfg.ddp.overlap_param_gather))


def materialize_parallel_model(
    model: torch.nn.Module,
    cfg: ConfigContainer,
    parallel: Any,
    seed: int,
    pre_wrap_hook: Callable[[torch.nn.Module], Any] | None = None,
) -> torch.nn.Module:
    """The model to train from a meta-device model (the whole model or one pipeline chunk).

    ``pre_wrap_hook(model)`` runs first (PEFT adapters), then ``model.fp8`` swaps the transformer layers'
    linears for torchao's FP8 ones, the parallel plans apply (``parallelize_model``), and the parameters
    are drawn from ``seed`` on ``parallel.device`` (only allocated with ``perform_initialization=False``:
    a checkpoint fills them next) and cast to ``model.params_dtype``.
    """
    provider = cfg.model
    if pre_wrap_hook is not None:
        pre_wrap_hook(model)
    dp_mode = data_parallel_mode(cfg, parallel.tp_size) if parallel.dp_size * parallel.cp_size > 1 else "none"
    apply_float8(model, provider, parallel.device, dp_mode)  # model.fp8: torchao float8 linears (CUDA only)
    model = parallelize_model(model, cfg, parallel)
    materialize_model(model, provider, seed, device=parallel.device)
    if provider.params_dtype is not None and provider.params_dtype != torch.float32:
        model = model.to(dtype=provider.params_dtype)
    return model
