"""``ModelParallelConfig``: how a model is split across devices, and its numeric precision.

Field names and defaults follow Megatron Core's ``core.model_parallel_config.ModelParallelConfig``. The class
is plain data: construction never validates (``ConfigContainer.validate()`` checks the sizes against the
world size and against each other), and the runtime hooks Megatron keeps here (timers, grad sync functions)
are set by the training code, never by a YAML file.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Callable, ContextManager, Literal, Optional

import torch

# Fields that hold runtime objects (functions, context managers) set by the training code. They are never
# written to or read from YAML.
RUNTIME_FIELD = {"yaml": False}


@dataclass
class ModelParallelConfig:
    """Parallel layout and precision shared by every model provider (Megatron Core's base config)."""

    # ---- parallel sizes -------------------------------------------------------------------------------
    tensor_model_parallel_size: int = 1
    """Number of ranks that split each layer's weight matrices (tensor parallelism)."""

    pipeline_model_parallel_comm_backend: Optional[Literal["nccl", "ucc"]] = None
    """Backend of the pipeline group's send/recv: 'nccl' (CUDA only; ignored on CPU), 'ucc' (a torch build with
    UCC); None uses the default process-group backend."""

    pipeline_model_parallel_size: int = 1
    """Number of pipeline stages the layers are divided into."""

    virtual_pipeline_model_parallel_size: Optional[int] = None
    """Model chunks per pipeline rank for the interleaved schedule; None means one chunk per rank."""

    sequence_parallel: bool = False
    """With tensor parallelism, also split norms and dropout along the sequence to save activation memory."""

    context_parallel_size: int = 1
    """Number of ranks that split each sequence (context parallelism)."""

    hierarchical_context_parallel_sizes: Optional[list[int]] = None
    """Group sizes of each level of hierarchical context parallelism (a2a then p2p), multiplying to
    context_parallel_size; read only with cp_comm_type='a2a+p2p'. longspan's context parallel is one all-gather
    group, so the sizes change only Megatron's communication schedule (no effect here)."""

    expert_model_parallel_size: int = 1
    """Number of ranks that split the MoE experts between them."""

    expert_tensor_parallel_size: Optional[int] = None
    """Tensor-parallel size inside each expert; None means the same as tensor_model_parallel_size."""

    moe_extended_tp: bool = False
    """Deprecated in Megatron Core 0.10 and ignored there too; replaced by expert_tensor_parallel_size."""

    # ---- initialization -------------------------------------------------------------------------------
    perform_initialization: bool = True
    """Initialize the weights; turning it off saves time when a checkpoint will overwrite them anyway."""

    use_cpu_initialization: bool = False
    """Create the initial weights on the CPU and move them to the accelerator afterwards."""

    # ---- precision ------------------------------------------------------------------------------------
    fp16: bool = False
    """Train in fp16 mixed precision (with loss scaling)."""

    bf16: bool = False
    """Train in bf16 mixed precision."""

    params_dtype: Optional[torch.dtype] = None
    """dtype of the weights when they are created; None is resolved by validate() (float32, bf16 or fp16)."""

    # ---- runtime hooks set by the training code ---------------------------------------------------------
    timers: Optional[Callable] = field(default=None, metadata=RUNTIME_FIELD)
    """Timers object used for timing measurements (set at runtime)."""

    finalize_model_grads_func: Optional[Callable] = field(default=None, metadata=RUNTIME_FIELD)
    """Function that completes gradient reduction across data/pipeline/sequence parallel ranks (runtime)."""

    grad_scale_func: Optional[Callable] = field(default=None, metadata=RUNTIME_FIELD)
    """Function that scales the loss for loss scaling; None means no scaling (runtime)."""

    no_sync_func: Optional[Callable] = field(default=None, metadata=RUNTIME_FIELD)
    """Context manager factory that suspends data-parallel gradient sync during accumulation (runtime)."""

    grad_sync_func: Optional[Callable] = field(default=None, metadata=RUNTIME_FIELD)
    """Function that launches asynchronous gradient reduction for a set of parameters (runtime)."""

    param_sync_func: Optional[Callable] = field(default=None, metadata=RUNTIME_FIELD)
    """Function that launches asynchronous parameter all-gathers for a set of parameters (runtime)."""

    # ---- determinism and autocast ----------------------------------------------------------------------
    deterministic_mode: bool = False
    """Prefer deterministic algorithms (slower, reproducible): useful for debugging and tests."""

    enable_autocast: bool = False
    """Run the forward step (train and eval) inside torch.autocast(autocast_dtype): fp32 weights, bf16/fp16
    matmuls. Set from mixed_precision.autocast_enabled when mixed_precision is given."""

    autocast_dtype: Optional[torch.dtype] = None
    """dtype for torch.autocast (torch.bfloat16 or torch.float16); None means the pipeline dtype. Setting it
    without enable_autocast is an error (it would change nothing)."""

    num_microbatches_with_partial_activation_checkpoints: Optional[int] = None
    """Pipelined runs with recompute_method='block': of each window of in-flight microbatches (the stage's warmup
    forwards + 1), the first N keep the partial recompute (recompute_num_layers) and the others recompute every
    layer of the stage; None leaves every microbatch partial. No effect without pipeline parallelism (Megatron's)."""

    # ---- fusions and TransformerEngine knobs ---------------------------------------------------------------
    gradient_accumulation_fusion: bool = False
    """Fuse weight-gradient accumulation into the GEMMs (needs APEX's CUDA extension)."""

    async_tensor_model_parallel_allreduce: bool = False
    """Deprecated in Megatron Core and ignored there."""

    use_te_rng_tracker: bool = False
    """Use TransformerEngine's RNG state tracker."""

    tp_comm_overlap: bool = False
    """Overlap sequence parallel's all-gather/reduce-scatter with the linear layers' GEMMs: torch's asynchronous
    TP (inductor micro-pipelining over symmetric memory, longspan.parallel.async_tp) on CUDA; needs
    sequence_parallel and a train.torch_compile that is not False."""

    tp_comm_bulk_wgrad: bool = True
    """With tp_comm_overlap: overlap the all-gather with the activation-gradient GEMM."""

    tp_comm_bulk_dgrad: bool = True
    """With tp_comm_overlap: overlap the reduce-scatter with the weight-gradient GEMM."""

    tp_comm_overlap_ag: bool = True
    """With tp_comm_overlap: pipeline GEMM and all-gather."""

    tp_comm_overlap_rs: bool = True
    """With tp_comm_overlap: pipeline GEMM and reduce-scatter."""

    tp_comm_overlap_rs_dgrad: bool = False
    """With tp_comm_overlap: pipeline the data-gradient GEMM and reduce-scatter."""

    tp_comm_split_ag: bool = True
    """Deprecated TransformerEngine knob: split all-gather overlap with the forward GEMM."""

    tp_comm_atomic_ag: bool = False
    """Deprecated TransformerEngine knob: atomic all-gather overlap with the forward GEMM."""

    tp_comm_split_rs: bool = True
    """Deprecated TransformerEngine knob: split reduce-scatter overlap with the forward GEMM."""

    tp_comm_atomic_rs: bool = False
    """Deprecated TransformerEngine knob: atomic reduce-scatter overlap with the forward GEMM."""

    cross_entropy_loss_fusion: bool = False
    """Fuse the output layer with the cross-entropy: longspan computes the training loss chunk by chunk over
    tokens (longspan.models.loss; vocab-parallel under tensor parallel), never materialising the
    [b, s, vocab] logits; same losses and gradients, one extra output matmul in backward."""

    cross_entropy_fusion_impl: Literal["native", "te"] = "native"
    """Which fused cross-entropy kernel: 'native' or 'te' (Transformer Engine's); both name the same
    cross-entropy, which longspan's chunked linear + cross-entropy computes (a hint)."""

    tp_comm_overlap_disable_qkv: bool = False
    """With tp_comm_overlap: do not overlap the all-gather before the QKV GEMM."""

    tp_comm_overlap_disable_fc1: bool = False
    """With tp_comm_overlap: do not overlap the all-gather before the first MLP GEMM."""

    tp_comm_bootstrap_backend: Literal["nccl", "mpi", "gloo"] = "nccl"
    """Backend that bootstraps TransformerEngine's userbuffers: 'nccl', 'mpi' or 'gloo'."""

    overlap_moe_expert_parallel_comm: bool = False
    """Overlap expert-parallel all-to-all with computation of other microbatches."""

    delay_wgrad_compute: bool = False
    """Delay weight-gradient computation to overlap more communication."""

    # ---- pipeline communication ---------------------------------------------------------------------------
    pipeline_dtype: Optional[torch.dtype] = None
    """dtype of activations sent between pipeline stages; None is resolved to params_dtype by validate()."""

    variable_seq_lengths: bool = False
    """Sequence length may change between microbatches, so pipeline stages exchange tensor shapes first. longspan's
    stages exchange seq_length-shaped activations (the data pads to seq_length under pipeline parallel): no effect."""

    overlap_p2p_comm: bool = False
    """Overlap pipeline send/recv with computation (requires batch_p2p_comm=False)."""

    batch_p2p_comm: bool = True
    """Send and receive pipeline tensors with one batch_isend_irecv call (requires overlap_p2p_comm=False)."""

    batch_p2p_sync: bool = True
    """Synchronize the device after batch_isend_irecv (a workaround for old PyTorch versions). Performance
    hint in longspan: torch.distributed.pipelining waits on its own p2p requests."""

    use_ring_exchange_p2p: bool = False
    """Use a custom ring_exchange kernel for pipeline communication (needs a custom PyTorch build)."""

    deallocate_pipeline_outputs: bool = False
    """Free a stage's output tensor once it has been sent to the next stage."""

    defer_embedding_wgrad_compute: bool = False
    """Defer the embedding weight-gradient GEMMs to the pipeline flush."""

    wgrad_deferral_limit: int = 0
    """With defer_embedding_wgrad_compute: microbatches to defer; 0 defers all of them."""

    overlap_p2p_comm_warmup_flush: bool = False
    """Overlap communication in the warm-up and flush phases (needs overlap_p2p_comm, no batch_p2p_comm)."""

    microbatch_group_size_per_vp_stage: Optional[int] = None
    """Microbatches run back to back on one virtual stage; None means pipeline_model_parallel_size."""

    pipeline_parallel_schedule: Optional[str] = None
    """longspan's own (torchtitan's name; Megatron Bridge has no such field): the torch.distributed.pipelining
    schedule. None: Megatron's (1F1B; interleaved 1F1B with virtual_pipeline_model_parallel_size). '1F1B',
    'GPipe', 'Interleaved1F1B', 'InterleavedZeroBubble' (ZB1P: each backward split into input and weight
    gradients, the weight ones filling the bubble), 'ZBVZeroBubble' and 'DualPipeV' (V-shaped: two stages per
    rank, stage r and 2 pp - 1 - r, so they need virtual_pipeline_model_parallel_size=2). The zero-bubble ones
    run with pipeline and tensor parallel only (no data or context parallel yet). longspan.core.pipeline_schedules
    lists them with the bubble the planner assumes."""

    # ---- activation/weight offloading ------------------------------------------------------------------------
    cpu_offloading: bool = False
    """Keep what the first cpu_offloading_num_layers layers save for backward in host memory (torch saved-tensor
    hooks, longspan.parallel.offload); not with activation recompute or train.torch_compile=True."""

    cpu_offloading_num_layers: int = 0
    """Transformer layers (the first ones of each model chunk) whose saved tensors are offloaded; below num_layers."""

    _cpu_offloading_context: Optional[ContextManager] = field(default=None, repr=False, metadata=RUNTIME_FIELD)
    """Internal offloading context; never set by users."""

    cpu_offloading_activations: bool = True
    """With cpu_offloading: offload the layer's saved inputs and intermediate results."""

    cpu_offloading_weights: bool = False
    """With cpu_offloading: offload the layer's parameters that autograd saves (as the forward used them)."""

    cpu_offloading_double_buffering: bool = False
    """With cpu_offloading: Transformer Engine's double-buffered reloads; torch's copies are asynchronous per
    tensor, so this changes nothing here."""

    barrier_with_L1_time: bool = True
    """Put a barrier before level-1 timer measurements (all ranks must call such timers)."""

    def __post_init__(self) -> None:
        """Nothing to do: checks and derived values live in ``ConfigContainer.validate()`` (lazy validation)."""



#: the fields a model inherits from ModelParallelConfig: its layout and precision, not its architecture
PARALLEL_CONFIG_FIELDS = frozenset(f.name for f in fields(ModelParallelConfig))
