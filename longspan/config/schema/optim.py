"""Optimizer, data-parallel and mixed-precision configs (Megatron Core / Megatron Bridge field names)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal, Optional

import torch

from longspan.core.errors import ConfigError, NotSupportedError


@dataclass
class OptimizerConfig:
    """Optimizer settings (Megatron Core's OptimizerConfig)."""

    optimizer: Literal["adam", "sgd", "muon", "dist_muon"] = "adam"
    """Optimizer: 'adam' (AdamW with decoupled weight decay by default), 'sgd', or 'muon' (orthogonalised momentum
    on the weight matrices, AdamW on embeddings, output layer, norms and biases: the ``muon_*`` fields).
    'dist_muon' (Megatron's layer-wise distributed Muon) is not supported yet: 'muon' with
    use_distributed_optimizer=True shards Muon's state over the data-parallel ranks."""

    lr: Optional[float] = None
    """Peak learning rate (required)."""

    finetune_lr: Optional[float] = None
    """Megatron Bridge's recipe argument for the finetuning learning rate: when the run finetunes
    (checkpoint.pretrained_checkpoint, checkpoint.finetune or peft set) validate() sets lr to it, with a one-line
    notice; a pretraining run rejects it (set lr)."""

    min_lr: Optional[float] = None
    """Learning rate at the end of decay; None is resolved to 0.0 by validate()."""

    decoupled_lr: Optional[float] = None
    """Peak learning rate of the input embedding and the output layer (their own param group, scheduled by the
    same scheduler as ``lr``); None = the same as ``lr``."""

    decoupled_min_lr: Optional[float] = None
    """Minimum learning rate of the input embedding and the output layer (needs ``decoupled_lr``); None = ``min_lr``."""

    weight_decay: float = 0.01
    """Weight decay coefficient (biases and norm weights get none)."""

    apply_wd_to_qk_layernorm: bool = False
    """Also decay the QK-norm parameters (names with ``q_layernorm.`` / ``k_layernorm.``), which otherwise
    get no weight decay like every 1-D parameter (megatron-core's Qwen3-Next rule)."""

    fp16: bool = False
    """The model trains in fp16 (loss scaling, fp32 main weights)."""

    bf16: bool = False
    """The model trains in bf16 (fp32 main weights)."""

    params_dtype: torch.dtype = torch.float32
    """dtype of the model parameters the optimizer sees."""

    use_precision_aware_optimizer: bool = False
    """Let the optimizer keep main params/grads/moments in the dtypes below (TransformerEngine FusedAdam)."""

    main_grads_dtype: torch.dtype = torch.float32
    """dtype of the main gradients (precision-aware optimizer)."""

    main_params_dtype: torch.dtype = torch.float32
    """dtype of the main parameters (precision-aware optimizer)."""

    exp_avg_dtype: torch.dtype = torch.float32
    """dtype of Adam's first moment (precision-aware optimizer)."""

    exp_avg_sq_dtype: torch.dtype = torch.float32
    """dtype of Adam's second moment (precision-aware optimizer)."""

    loss_scale: Optional[float] = None
    """Static loss scale for fp16; None means dynamic loss scaling."""

    initial_loss_scale: float = 2.0**32
    """Starting dynamic loss scale."""

    min_loss_scale: float = 1.0
    """Smallest dynamic loss scale."""

    loss_scale_window: float = 1000
    """Iterations without overflow before the dynamic loss scale grows."""

    hysteresis: int = 2
    """Overflows tolerated before the dynamic loss scale shrinks."""

    adam_beta1: float = 0.9
    """Adam's first-moment decay."""

    adam_beta2: float = 0.999
    """Adam's second-moment decay."""

    adam_eps: float = 1e-8
    """Adam's epsilon."""

    decoupled_weight_decay: bool = True
    """Adam with decoupled weight decay (AdamW); False adds the decay to the gradient (L2)."""

    sgd_momentum: float = 0.9
    """SGD momentum."""

    muon_momentum: float = 0.95
    """Muon's momentum: the EMA coefficient of its momentum buffer (B = mu*B + (1 - mu)*grad), in [0, 1)."""

    muon_split_qkv: bool = True
    """Orthogonalise the query, key and value projections as three matrices (Megatron splits its fused
    ``linear_qkv``); False orthogonalises them as one matrix, Megatron's fused one."""

    muon_use_nesterov: bool = False
    """Nesterov momentum: orthogonalise grad + mu*(B - grad) instead of the momentum buffer B."""

    muon_scale_mode: Literal["spectral", "unit_rms_norm", "shape_scaling"] = "spectral"
    """Scale of the orthogonalised update of an m x n matrix: 'spectral' sqrt(max(m, n)) (Moonlight's; with
    muon_extra_scale_factor=0.2 its update RMS matches AdamW's), 'unit_rms_norm' sqrt(m / n), 'shape_scaling'
    sqrt(max(1, m / n)) (Keller Jordan's)."""

    muon_fp32_matmul_prec: Literal["highest", "high", "medium"] = "medium"
    """Precision of the Newton-Schulz matmuls: 'medium' iterates in bf16 (Megatron's default), 'high' in fp32
    with TF32 allowed on CUDA, 'highest' in full fp32."""

    muon_num_ns_steps: int = 5
    """Newton-Schulz iterations; the five quintic coefficient sets (Megatron's 'quintic') are cycled, so a
    positive multiple of 5."""

    muon_tp_mode: Literal["blockwise", "duplicated", "distributed"] = "blockwise"
    """How a tensor-parallel matrix is orthogonalised: 'blockwise' (Megatron's default) each tensor-parallel
    rank's block on its own, scaled by the block's shape; 'duplicated' the whole matrix, gathered on every rank
    (the update one process computes). Data-parallel (FSDP2) shards are always gathered. 'distributed' is not
    supported yet (use 'duplicated': the same update)."""

    muon_extra_scale_factor: float = 1.0
    """Extra factor on every Muon update (0.2 with muon_scale_mode='spectral' is Moonlight's AdamW-RMS match)."""

    use_distributed_optimizer: bool = False
    """Shard optimizer state across data-parallel ranks (ZeRO-1); copied to ddp.use_distributed_optimizer."""

    overlap_param_gather: bool = False
    """With the distributed optimizer: overlap the parameter all-gather with the forward pass. One switch with
    ddp.overlap_param_gather (validate() sets both when either is set)."""

    overlap_param_gather_with_optimizer_step: bool = False
    """Overlap the parameter all-gather with the optimizer step (interleaved pipeline). Performance hint in
    longspan: the all-gathers start with each stage's forward; the gathered values are the same."""

    optimizer_cpu_offload: bool = False
    """Keep part of the optimizer on the CPU (Megatron's HybridDeviceOptimizer): the offloaded parameters get
    float32 host copies whose state and update live on the CPU; needs optimizer_offload_fraction > 0."""

    optimizer_offload_fraction: float = 0.0
    """Fraction of the rank's parameter elements (the first parameters in param-group order; of a sharded
    parameter, the rank's shard) whose optimizer state and update are on the CPU, in [0, 1]."""

    use_torch_optimizer_for_cpu_offload: bool = False
    """Use a torch optimizer for the offloaded part. Performance hint in longspan: the offloaded part always
    steps with torch's own optimizer (megatron-core 0.16 likewise ends up with torch's AdamW/SGD there)."""

    overlap_cpu_optimizer_d2h_h2d: bool = False
    """Copy the offloaded gradients to the host on a side CUDA stream (CUDA only)."""

    pin_cpu_grads: bool = True
    """Pin the host buffers of offloaded gradients (CUDA only)."""

    pin_cpu_params: bool = True
    """Pin the host copies of offloaded parameters (CUDA only)."""

    clip_grad: float = 1.0
    """Clip the global gradient L2 norm to this value (0 = no clipping)."""

    log_num_zeros_in_grad: bool = False
    """Count zero gradient entries and log them."""

    barrier_with_L1_time: bool = False
    """Put a barrier before the optimizer's level-1 timers."""


@dataclass
class DistributedDataParallelConfig:
    """Data-parallel gradient reduction settings (Megatron Core's DistributedDataParallelConfig)."""

    grad_reduce_in_fp32: bool = False
    """Accumulate and reduce gradients in fp32 even when the model is bf16/fp16."""

    overlap_grad_reduce: bool = False
    """Overlap gradient reduction with the backward pass. Performance hint in longspan: torch DDP always
    overlaps its bucketed all-reduce with backward, FSDP2 its reduce-scatter; the gradients are the same."""

    overlap_param_gather: bool = False
    """With the distributed optimizer: overlap the parameter all-gather with the forward pass."""

    align_param_gather: bool = False
    """With pipeline parallelism: launch every stage's parameter all-gather together. Performance hint in
    longspan: each pipeline stage's FSDP2 all-gather starts with that stage's forward; the gathered values are
    the same."""

    use_distributed_optimizer: bool = False
    """Shard optimizer state across data-parallel ranks (set from optimizer.use_distributed_optimizer)."""

    num_distributed_optimizer_instances: int = 1
    """Replicas of the distributed optimizer (hybrid sharding, HSDP): the data-parallel ranks form this many
    replicas, each sharding the state over its own ranks, gradients all-reduced across replicas; 1 shards
    across all data-parallel ranks. Needs the distributed optimizer or FSDP2."""

    check_for_nan_in_grad: bool = False
    """Stop the run (one line naming the iteration) when a rank's reduced gradients hold NaN or Inf, before the
    optimizer step. Under fp16 loss scaling the scaler handles such steps (it skips them) instead."""

    check_for_large_grads: bool = False
    """Stop the run when a rank's reduced-gradient norm is at least 10x the largest of its first 100 norms
    (Megatron's ``is_unexpectedly_large``)."""

    bucket_size: Optional[int] = None
    """Gradient bucket size in elements; None lets the wrapper pick."""

    pad_buckets_for_high_nccl_busbw: bool = False
    """Pad buckets to sizes that give NCCL high bus bandwidth. Performance hint in longspan: torch DDP's buckets
    reduce the same gradients unpadded."""

    average_in_collective: bool = False
    """Average gradients inside the collective instead of dividing before it."""

    fp8_param_gather: bool = False
    """All-gather parameters in FP8: switches on model.fp8_param (FSDP2's float8 all-gather; FP8 hardware)."""

    use_megatron_fsdp: bool = False
    """Use Megatron's own FSDP implementation. longspan runs PyTorch FSDP2 in its place (said once at start-up),
    with Megatron Bridge's contract: always the distributed optimizer; 'optim_grads_params' shards the parameters
    too (dist.use_torch_fsdp2's mode), the other strategies shard gradients and optimizer state. Not with
    dist.use_torch_fsdp2 or dist.use_tp_pp_dp_mapping."""

    use_custom_fsdp: bool = False
    """Deprecated name of use_megatron_fsdp (the same effect)."""

    data_parallel_sharding_strategy: Literal[
        "no_shard", "optim", "optim_grads", "optim_grads_params"
    ] = "no_shard"
    """Megatron-FSDP's sharding strategy, on PyTorch FSDP2: 'no_shard' (DDP); 'optim' and 'optim_grads' switch
    on the distributed optimizer (optimizer state and gradients sharded); 'optim_grads_params' switches on
    dist.use_torch_fsdp2 (parameters sharded too)."""

    gradient_reduce_div_fusion: bool = True
    """Fuse the gradient division into the reduction (Megatron FSDP). Performance hint in longspan: FSDP2
    averages in its reduce-scatter; the gradients are the same."""

    suggested_communication_unit_size: Optional[int] = None
    """Megatron FSDP communication unit size. Performance hint in longspan: FSDP2 communicates one
    transformer layer (one fully_shard unit) at a time."""

    preserve_fp32_weights: bool = True
    """Keep fp32 master weights (Megatron FSDP)."""

    keep_fp8_transpose_cache: bool = False
    """Keep FP8 transposed weights cached (Megatron FSDP)."""

    nccl_ub: bool = False
    """Register NCCL user buffers."""

    fsdp_double_buffer: bool = False
    """Double-buffer Megatron FSDP all-gathers."""

    delay_wgrad_compute: bool = False
    """Delay weight-gradient computation for more overlap."""


@dataclass(kw_only=True)
class MixedPrecisionConfig:
    """One place for the precision settings of model, optimizer and DDP (Megatron Bridge).

    ``ConfigContainer.validate()`` copies each field onto the model, optimizer and ddp configs that have it.
    """

    fp32: bool = False
    """Plain fp32 training."""

    fp16: bool = False
    """fp16 mixed precision."""

    bf16: bool = False
    """bf16 mixed precision."""

    params_dtype: Optional[torch.dtype] = None
    """dtype of the model weights."""

    pipeline_dtype: Optional[torch.dtype] = None
    """dtype of activations between pipeline stages."""

    autocast_dtype: Optional[torch.dtype] = None
    """dtype of torch.autocast."""

    autocast_enabled: bool = False
    """Run the forward step under torch.autocast."""

    grad_reduce_in_fp32: bool = True
    """Reduce gradients in fp32."""

    fp8: Optional[str] = None
    """FP8 format; None = off."""

    fp8_recipe: str = "tensorwise"
    """FP8 scaling recipe."""

    fp8_param_gather: bool = False
    """With fp8: FSDP2 all-gathers the float8 weights (copied to model.fp8_param, as Megatron's
    --fp8-param-gather; torchao, fp8_recipe='tensorwise')."""

    loss_scale: Optional[float] = None
    """Static fp16 loss scale; None = dynamic."""

    initial_loss_scale: Optional[float] = 4294967296
    """Starting dynamic loss scale."""

    min_loss_scale: float = 1.0
    """Smallest dynamic loss scale."""

    loss_scale_window: float = 1000
    """Iterations without overflow before the loss scale grows."""

    hysteresis: int = 2
    """Overflows tolerated before the loss scale shrinks."""


def bf16_mixed() -> MixedPrecisionConfig:
    """bf16 weights and compute, fp32 gradient reduction and optimizer state."""
    return MixedPrecisionConfig(bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
                                autocast_enabled=False, grad_reduce_in_fp32=True)


def fp16_mixed() -> MixedPrecisionConfig:
    """fp16 weights and compute with dynamic loss scaling."""
    return MixedPrecisionConfig(fp16=True, params_dtype=torch.half, pipeline_dtype=torch.half,
                                autocast_enabled=False, grad_reduce_in_fp32=False)


def fp32() -> MixedPrecisionConfig:
    """Plain fp32 training."""
    return MixedPrecisionConfig(fp32=True, params_dtype=torch.float32, pipeline_dtype=torch.float32,
                                autocast_enabled=False, grad_reduce_in_fp32=True)


def _bf16_with_fp8(recipe: str, fp8: str) -> Any:
    def factory() -> MixedPrecisionConfig:
        mp = bf16_mixed()
        mp.fp8, mp.fp8_recipe = fp8, recipe
        return mp

    factory.__doc__ = f"bf16 mixed with FP8 ({fp8}, recipe {recipe!r}) linears in the transformer layers."
    return factory


MIXED_PRECISION_RECIPES = {
    "bf16_mixed": bf16_mixed, "fp16_mixed": fp16_mixed, "fp32": fp32,
    # Megatron Bridge's FP8 recipe names onto torchao's recipes (longspan.parallel.float8, which
    # checks them against the hardware when the model is built). The fp8 format is what torchao's kernels
    # compute: its blockwise and MXFP8 kernels cast gradients to e4m3 too, so those set 'e4m3' where Bridge
    # (TransformerEngine) sets 'hybrid'. Delayed scaling loads and is rejected in one line (torchao removed it).
    "bf16_with_fp8_current_scaling_mixed": _bf16_with_fp8("tensorwise", "hybrid"),
    "bf16_with_fp8_delayed_scaling_mixed": _bf16_with_fp8("delayed", "hybrid"),
    "bf16_with_fp8_mixed": _bf16_with_fp8("delayed", "hybrid"),
    "bf16_with_fp8_subchannel_scaling_mixed": _bf16_with_fp8("blockwise", "e4m3"),
    "bf16_with_mxfp8_mixed": _bf16_with_fp8("mxfp8", "e4m3"),
}


def get_mixed_precision_config(name: str) -> Optional[MixedPrecisionConfig]:
    """The MixedPrecisionConfig for a recipe name ('bf16_mixed', 'bf16-mixed', 'fp16_mixed', 'fp32'), or None."""
    factory = MIXED_PRECISION_RECIPES.get(name.replace("-", "_"))
    return factory() if factory else None


def apply_mixed_precision(mp: MixedPrecisionConfig, *targets: object) -> None:
    """Copy every MixedPrecisionConfig field onto each target config that has a field of that name
    (fp8_param_gather onto the model's fp8_param)."""
    for target in targets:
        names = {f.name for f in fields(target)}  # type: ignore[arg-type]
        for f in fields(mp):
            # fp8 settings only travel when fp8 is on, so fp32/bf16 recipes leave the fp8 knobs at their defaults.
            if f.name.startswith("fp8") and mp.fp8 is None:
                continue
            if f.name == "fp8_param_gather":  # Megatron's --fp8-param-gather is the model's fp8_param (below)
                continue
            if f.name in names:
                setattr(target, f.name, getattr(mp, f.name))
        if mp.fp8 is not None and mp.fp8_param_gather and "fp8_param" in names:
            setattr(target, "fp8_param", True)
        # autocast_enabled is called enable_autocast on the model.
        if "enable_autocast" in names:
            setattr(target, "enable_autocast", mp.autocast_enabled)


# --- Megatron's validity rules for the precision-aware optimizer and the overlapped parameter gather ------------
# (megatron-core OptimizerConfig.__post_init__ and Megatron-LM's argument checks, as one-line errors).
_DTYPE_CHOICES = {
    "main_grads_dtype": (torch.float32, torch.bfloat16),
    "main_params_dtype": (torch.float32, torch.float16),
    "exp_avg_dtype": (torch.float32, torch.float16, torch.bfloat16),
    "exp_avg_sq_dtype": (torch.float32, torch.float16, torch.bfloat16),
}


def check_precision_aware_optimizer(opt: OptimizerConfig, ddp: DistributedDataParallelConfig,
                                    use_torch_fsdp2: bool = False) -> None:
    """Reject precision-aware optimizer settings Megatron rejects, or longspan cannot honour, in one line."""
    if not opt.use_precision_aware_optimizer:
        for name in _DTYPE_CHOICES:
            if getattr(opt, name) != torch.float32:
                raise ConfigError(f"optimizer.{name}={getattr(opt, name)} needs "
                                  "optimizer.use_precision_aware_optimizer=True (or set it to torch.float32)")
        return
    if opt.optimizer != "adam":
        raise ConfigError(f"optimizer.use_precision_aware_optimizer=True works with optimizer='adam' only, "
                          f"not {opt.optimizer!r}")
    if not (opt.use_distributed_optimizer or use_torch_fsdp2):
        raise ConfigError("optimizer.use_precision_aware_optimizer=True needs the distributed optimizer (as in "
                          "Megatron): set optimizer.use_distributed_optimizer=True or dist.use_torch_fsdp2=True")
    for name, choices in _DTYPE_CHOICES.items():
        value = getattr(opt, name)
        if value not in choices:
            valid = ", ".join(str(c) for c in choices)
            if value == torch.uint8 and name.startswith("exp_avg"):
                raise NotSupportedError(f"optimizer.{name}=torch.uint8 (fp8 moments, TransformerEngine only) is not "
                                        f"supported yet: use one of {valid}")
            raise ConfigError(f"optimizer.{name}={value} is invalid: use one of {valid}")
    low_precision_model = opt.bf16 or opt.fp16
    if opt.main_params_dtype == torch.float16 and not low_precision_model:
        raise ConfigError("optimizer.main_params_dtype=torch.float16 sets the dtype of the main copies of bf16/fp16 "
                          "parameters, but this model trains in fp32: set bf16 (mixed_precision=bf16_mixed) or "
                          "main_params_dtype=torch.float32")
    if opt.main_grads_dtype == torch.bfloat16:
        if not opt.bf16:
            raise ConfigError("optimizer.main_grads_dtype=torch.bfloat16 keeps the bf16 model's gradients in bf16, but "
                              "this model does not train in bf16: set bf16 (mixed_precision=bf16_mixed) or "
                              "main_grads_dtype=torch.float32")
        if ddp.grad_reduce_in_fp32:
            raise ConfigError("optimizer.main_grads_dtype=torch.bfloat16 with ddp.grad_reduce_in_fp32=True: Megatron "
                              "allows bf16 main gradients only without fp32 reduction; set grad_reduce_in_fp32=False "
                              "(mixed_precision.grad_reduce_in_fp32 with a recipe) or main_grads_dtype=torch.float32")


def check_overlap_param_gather(ddp: DistributedDataParallelConfig, use_distributed_optimizer: bool,
                               use_torch_fsdp2: bool = False) -> None:
    """``ddp.overlap_param_gather`` needs sharded parameters and ``overlap_grad_reduce`` (Megatron's rules)."""
    if not ddp.overlap_param_gather:
        return
    if not (use_distributed_optimizer or use_torch_fsdp2):
        raise ConfigError("ddp.overlap_param_gather=True needs sharded parameters to gather: set "
                          "optimizer.use_distributed_optimizer=True or dist.use_torch_fsdp2=True (plain DDP gathers "
                          "no parameters)")
    if not ddp.overlap_grad_reduce:
        raise ConfigError("ddp.overlap_param_gather=True needs ddp.overlap_grad_reduce=True (as in Megatron)")
