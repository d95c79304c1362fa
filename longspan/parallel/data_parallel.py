"""Data parallel wrappers: DDP, FSDP2 (``fully_shard``), the distributed optimizer, hybrid sharding.

Which one a run gets (``data_parallel_mode``):

- ``"ddp"`` (default): ``torch.nn.parallel.DistributedDataParallel`` over the data-parallel group (dp × cp).
  ``ddp.bucket_size`` (elements) becomes ``bucket_cap_mb``; ``ddp.grad_reduce_in_fp32`` reduces low-precision
  gradients in fp32 and ``ddp.average_in_collective`` averages inside the collective (``ReduceOp.AVG`` where
  the backend has it), both through a DDP communication hook. DDP always overlaps the reduction with the
  backward pass (``ddp.overlap_grad_reduce`` changes when, not what, is reduced). Gradients are averaged over
  the data-parallel ranks, as in Megatron.
- ``"fsdp2"`` (``dist.use_torch_fsdp2``; ``ddp.use_megatron_fsdp`` with the 'optim_grads_params' strategy, FSDP2
  running in Megatron-FSDP's place): ``fully_shard`` on every transformer layer, then on the root; the
  mixed precision policy computes in bf16/fp16 when the model does (``model.bf16`` / ``model.fp16``) and
  reduces in fp32 with ``ddp.grad_reduce_in_fp32``; layers reshard after forward (ZeRO-3).
  ``ddp.overlap_param_gather`` turns on explicit prefetch: each layer starts the next one's all-gather
  (``set_explicit_prefetch``).
- ``"distributed_optimizer"`` (``optimizer.use_distributed_optimizer``; ``ddp.use_megatron_fsdp`` with another
  strategy): Megatron's ZeRO-1/2 semantics —
  optimizer state and gradients sharded across data-parallel ranks as DTensors (so DCP can save and
  reshard them) — realized as FSDP2 with ``reshard_after_forward=False``: parameters stay gathered from
  forward to backward (no second all-gather, as with replicated parameters), gradients are reduce-scattered,
  and the optimizer steps on its shard only. ``ddp.overlap_param_gather`` prefetches the next layer's
  all-gather in forward here too (Megatron overlaps the distributed optimizer's parameter all-gather with
  the next forward pass); plain DDP gathers no parameters, so validate() rejects the flag there.

Tensor parallel composes with FSDP2 (2-D mesh: dp × tp, torchtitan's way); DDP does not compose with
DTensor parameters, so dp > 1 with tp > 1 and neither FSDP2 nor the distributed optimizer uses FSDP2 with
``reshard_after_forward=False`` (the same maths as DDP) and says so once.

Hybrid sharding: when the mesh has ``dp_replicate`` > 1, FSDP2 gets the 2-D ``(dp_replicate, dp_shard)``
mesh (HSDP: shard within a replica, all-reduce across replicas); DDP ignores the split (it replicates
everywhere anyway).

Every wrapper exposes ``no_sync()`` (DDP has it; FSDP2 gets a small context manager that turns gradient
reduction off with ``set_requires_gradient_sync``), which the trainer enters for all but the last
microbatch.

Parameters are materialized before DDP wraps the model (``to_empty``; ``init_weights`` fills them in place
afterwards), so DDP's initial broadcast would copy garbage and is skipped; instead the wrapper broadcasts the
parameters from data-parallel rank 0 once, at the first forward (Megatron's ``broadcast_params``), so the
replicas start equal even when ranks initialized differently (``rng.data_parallel_random_init``). FSDP2
shards the meta model and ``init_weights`` materializes each shard.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from longspan.config.schema.optim import DistributedDataParallelConfig
from longspan.core.errors import NotSupportedError
from longspan.core.logging import get_logger

if TYPE_CHECKING:
    from longspan.config.schema.container import ConfigContainer
    from longspan.core.model_parallel_config import ModelParallelConfig

_log = get_logger(__name__)

DDP_MODE = "ddp"
FSDP2_MODE = "fsdp2"
DISTRIBUTED_OPTIMIZER_MODE = "distributed_optimizer"


def data_parallel_mode(cfg: ConfigContainer, tp_size: int = 1) -> str:
    """``"ddp"``, ``"fsdp2"`` or ``"distributed_optimizer"`` for ``cfg`` (see the module docstring)."""
    if cfg.dist.use_torch_fsdp2:
        return FSDP2_MODE
    if cfg.ddp.use_megatron_fsdp or cfg.ddp.use_custom_fsdp:
        # FSDP2 in Megatron-FSDP's place: the strategy says whether parameters are sharded between uses too
        strategy = cfg.ddp.data_parallel_sharding_strategy
        return FSDP2_MODE if strategy == "optim_grads_params" else DISTRIBUTED_OPTIMIZER_MODE
    optimizer_shards = cfg.optimizer is not None and cfg.optimizer.use_distributed_optimizer
    if optimizer_shards or cfg.ddp.use_distributed_optimizer:
        return DISTRIBUTED_OPTIMIZER_MODE
    return DDP_MODE


def check_data_parallel_config(cfg: ConfigContainer) -> None:
    """Reject DDP settings this build cannot honour (one line each)."""
    bucket = cfg.ddp.bucket_size
    if bucket is not None and (isinstance(bucket, bool) or not isinstance(bucket, int) or bucket < 1):
        raise NotSupportedError(f"ddp.bucket_size={bucket!r} must be a positive number of elements or None")


# --------------------------------------------------------------------------------------------------- DDP

def _reduce_hook(state, bucket):  # noqa: ANN001, ANN201 - DDP checks real annotations; ours would be strings
    """DDP communication hook: average a gradient bucket (a ``GradBucket``) over the group, in fp32 when asked;
    returns a Future of the reduced bucket."""
    group = state["group"]
    world = dist.get_world_size(group)
    grads = bucket.buffer()
    work_tensor = grads.float() if state["fp32"] and grads.dtype != torch.float32 else grads
    if state["avg_op"]:
        fut = dist.all_reduce(work_tensor, op=dist.ReduceOp.AVG, group=group, async_op=True).get_future()
    else:
        work_tensor.div_(world)
        fut = dist.all_reduce(work_tensor, group=group, async_op=True).get_future()

    def done(f):  # noqa: ANN001, ANN202
        reduced = f.value()[0]
        if reduced is not grads:
            grads.copy_(reduced)
        return grads

    return fut.then(done)


def _broadcast_at_first_forward(wrapped: nn.Module, group: Any) -> None:
    """Broadcast parameters and buffers from the group's first rank before the first forward, then unhook."""
    src = dist.get_global_rank(group, 0) if group is not None else 0

    def hook(module: nn.Module, args: Any) -> None:
        # Parameters DDP ignores (expert-parallel shards, which differ per rank by design) stay as they are.
        ignored = set(getattr(module.module, "_ddp_params_and_buffers_to_ignore", ()))
        with torch.no_grad():
            named = [*module.module.named_parameters(), *module.module.named_buffers()]
            for name, tensor in named:
                if name in ignored or hasattr(tensor, "to_local"):
                    continue
                dist.broadcast(tensor.data, src=src, group=group)
        handle.remove()

    handle = wrapped.register_forward_pre_hook(hook)


def apply_ddp(model: nn.Module, group: Any, device: torch.device,
              ddp_cfg: DistributedDataParallelConfig | None = None,
              param_dtype: torch.dtype | None = None) -> nn.Module:
    """Materialize ``model`` on ``device`` (if on meta) and wrap it in DDP over ``group``.

    Args:
        model: a plain model (no DTensor parameters).
        group: the data-parallel process group.
        device: this rank's device.
        ddp_cfg: a DistributedDataParallelConfig (bucket_size, grad_reduce_in_fp32, average_in_collective);
            None: its defaults.
        param_dtype: the dtype the parameters will have in training (bucket sizes and the fp32 hook use it).
    """
    ddp_cfg = DistributedDataParallelConfig() if ddp_cfg is None else ddp_cfg
    if any(p.is_meta for p in model.parameters()):
        model.to_empty(device=device)
    param_dtype = param_dtype or next(model.parameters()).dtype
    kwargs: dict[str, Any] = {
        "process_group": group,
        # init_weights draws identical weights on every rank after this, so the broadcast would be wasted
        "init_sync": False,
    }
    if device.type == "cuda":
        kwargs["device_ids"] = [device]
    bucket_size = ddp_cfg.bucket_size
    if bucket_size is not None:
        element = torch.tensor([], dtype=param_dtype).element_size()
        kwargs["bucket_cap_mb"] = bucket_size * element / 2**20
    wrapped = DistributedDataParallel(model, **kwargs)
    _broadcast_at_first_forward(wrapped, group)
    fp32 = bool(ddp_cfg.grad_reduce_in_fp32) and param_dtype != torch.float32
    avg = bool(ddp_cfg.average_in_collective)
    avg_op = avg and "nccl" in str(dist.get_backend(group))  # gloo has no ReduceOp.AVG: SUM then divide
    if fp32 or avg_op:
        wrapped.register_comm_hook({"group": group, "fp32": fp32, "avg_op": avg_op}, _reduce_hook)
    return wrapped


# --------------------------------------------------------------------------------------------------- FSDP2

def _fsdp_no_sync(module: nn.Module) -> Any:
    """Build the ``no_sync`` context manager installed on an FSDP2 root module."""

    @contextlib.contextmanager
    def no_sync() -> Iterator[None]:
        module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)

    return no_sync


def mixed_precision_policy(model_cfg: ModelParallelConfig, ddp_cfg: DistributedDataParallelConfig) -> Any:
    """FSDP2's MixedPrecisionPolicy: compute in bf16/fp16 when the model does; fp32 reduction on request."""
    param_dtype = None
    if model_cfg.bf16:
        param_dtype = torch.bfloat16
    elif model_cfg.fp16:
        param_dtype = torch.float16
    reduce_dtype = torch.float32 if param_dtype is not None and ddp_cfg.grad_reduce_in_fp32 else None
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)


def apply_fsdp2(model: nn.Module, mesh: Any, *, mp_policy: Any = None, reshard_after_forward: bool = True,
                prefetch: bool = False) -> nn.Module:
    """``fully_shard`` each transformer layer of ``model`` then the root, over ``mesh`` (1-D: FSDP; 2-D
    ``(replicate, shard)``: HSDP). Works on the meta model; installs ``no_sync()`` on the root.

    ``prefetch`` (``ddp.overlap_param_gather``): explicit all-gather prefetch, see :func:`set_explicit_prefetch`.
    """
    mp_policy = mp_policy or MixedPrecisionPolicy()
    # a vision-language model's decoder is its language model's; its vision encoder stays in the root unit,
    # gathered on every rank whether or not that rank's microbatch has images
    decoder = getattr(model, "decoder", None) or getattr(getattr(model, "language_model", None), "decoder", None)
    layers = list(decoder.layers.values()) if decoder is not None else []
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
    # The root (embedding, final norm, output layer) is needed first in backward: keep it gathered.
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=False)
    if prefetch:
        set_explicit_prefetch(model, layers, backward=reshard_after_forward)
    model.no_sync = _fsdp_no_sync(model)
    return model


def set_explicit_prefetch(root: nn.Module, layers: list[nn.Module], backward: bool) -> None:
    """Megatron's ``overlap_param_gather`` on FSDP2: each module starts the next layer's parameter all-gather
    as soon as its own has been copied out, instead of when the next layer's forward begins.

    Forward: the root (embedding) prefetches layer 0 and layer i prefetches layer i + 1. Backward (only when
    layers reshard after forward, i.e. FSDP2 proper; the distributed optimizer keeps them gathered from
    forward to backward): layer i prefetches layer i - 1. The issued collectives and their results are the
    same as without it; what changes is that the next gather is already running during the current layer's
    compute (one more layer's gathered parameters held at a time).
    """
    if not layers:
        return
    root.set_modules_to_forward_prefetch([layers[0]])
    for i, layer in enumerate(layers):
        if i + 1 < len(layers):
            layer.set_modules_to_forward_prefetch([layers[i + 1]])
        if backward and i > 0:
            layer.set_modules_to_backward_prefetch([layers[i - 1]])


def data_parallel_mesh(parallel: Any) -> Any:
    """The mesh FSDP2 shards over: ``dp`` (× ``cp``), or the 2-D ``(dp_replicate, dp_shard)`` for HSDP."""
    if parallel.dp_replicate_size > 1:
        if parallel.cp_size > 1:
            raise NotSupportedError(
                f"hybrid sharding (dp_replicate={parallel.dp_replicate_size}) with context_parallel_size="
                f"{parallel.cp_size} is not supported: use one of them"
            )
        return parallel.mesh["dp_replicate", "dp_shard"]
    return parallel.submesh("dp_cp" if parallel.cp_size > 1 else "dp")
