"""Scheduler, training loop, checkpoint and logger configs of Bridge's training.config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

# Fields computed by ConfigContainer.validate(); not constructor arguments and not written to YAML.
DERIVED_FIELD = {"yaml": False, "derived": True}


@dataclass
class SchedulerConfig:
    """Learning-rate and weight-decay schedule (Megatron's OptimizerParamScheduler inputs)."""

    lr_decay_style: Literal["constant", "linear", "cosine", "inverse-square-root", "WSD"] = "linear"
    """Shape of the learning-rate decay after warmup."""

    lr_wsd_decay_style: Literal["exponential", "linear", "cosine", "minus_sqrt"] = "exponential"
    """Shape of the final annealing phase of the WSD schedule."""

    lr_decay_iters: Optional[int] = None
    """Iterations over which the learning rate decays; None means train.train_iters."""

    lr_decay_samples: Optional[int] = None
    """Samples over which the learning rate decays (sample-based training); None means train.train_samples."""

    lr_wsd_decay_iters: Optional[int] = None
    """Iterations of the WSD annealing phase."""

    lr_wsd_decay_samples: Optional[int] = None
    """Samples of the WSD annealing phase (sample-based training)."""

    lr_warmup_fraction: Optional[float] = None
    """Warmup length as a fraction of the decay length (instead of lr_warmup_iters/samples)."""

    lr_warmup_iters: int = 0
    """Iterations of linear warmup."""

    lr_warmup_samples: int = 0
    """Samples of linear warmup (sample-based training)."""

    lr_warmup_init: float = 0.0
    """Learning rate at the start of warmup."""

    override_opt_param_scheduler: bool = False
    """On resume, take the schedule settings from this config and ignore the checkpoint's."""

    use_checkpoint_opt_param_scheduler: bool = False
    """On resume, take the schedule settings from the checkpoint and ignore this config's."""

    start_weight_decay: Optional[float] = None
    """Weight decay at the start; None means optimizer.weight_decay."""

    end_weight_decay: Optional[float] = None
    """Weight decay at the end; None means optimizer.weight_decay."""

    weight_decay_incr_style: Literal["constant", "linear", "cosine"] = "constant"
    """How the weight decay moves from start to end."""

    lr_warmup_steps: Optional[int] = field(default=None, init=False, compare=False, metadata=DERIVED_FIELD)
    """Warmup length in samples (computed by validate())."""

    lr_decay_steps: Optional[int] = field(default=None, init=False, compare=False, metadata=DERIVED_FIELD)
    """Decay length in samples (computed by validate())."""

    wd_incr_steps: Optional[int] = field(default=None, init=False, compare=False, metadata=DERIVED_FIELD)
    """Weight-decay increment length in samples (computed by validate())."""

    wsd_decay_steps: Optional[int] = field(default=None, init=False, compare=False, metadata=DERIVED_FIELD)
    """WSD annealing length in samples (computed by validate())."""

    def __post_init__(self) -> None:
        """Nothing: checks run in ``ConfigContainer.validate()`` (lazy validation)."""


@dataclass
class TrainingConfig:
    """The training loop and evaluation."""

    micro_batch_size: Optional[int] = None
    """Samples per forward/backward pass on one data-parallel rank."""

    global_batch_size: Optional[int] = None
    """Samples per optimizer step over all ranks: micro_batch_size x data-parallel size x microbatches.
    None means micro_batch_size x data-parallel size (one microbatch)."""

    rampup_batch_size: Optional[list[int]] = None
    """[start, increment, ramp samples]: grow the global batch from start to global_batch_size in steps of
    increment over ramp samples (sample-based training only)."""

    decrease_batch_size_if_needed: bool = False
    """When micro_batch_size x data-parallel size does not divide global_batch_size, round the global batch
    down to a multiple instead of failing."""

    empty_unused_memory_level: Literal[0, 1, 2] = 0
    """Release cached accelerator memory each iteration: 0 off, 1 moderate, 2 aggressive."""

    check_weight_hash_across_dp_replicas_interval: Optional[int] = None
    """Every this many iterations, check that data-parallel replicas hold identical weights."""

    train_sync_interval: Optional[int] = None
    """Synchronize host and accelerator every this many iterations."""

    train_iters: Optional[int] = None
    """Total iterations over all runs (give this or train_samples)."""

    train_samples: Optional[int] = None
    """Total samples over all runs, instead of train_iters (Megatron-LM's sample-based training)."""

    exit_interval: Optional[int] = None
    """Save and exit when the iteration number is a multiple of this."""

    exit_duration_in_mins: Optional[int] = None
    """Save and exit after this many minutes."""

    exit_signal_handler: bool = False
    """On exit_signal (SIGTERM by default): save a checkpoint and exit cleanly."""

    exit_signal: Optional[int] = None
    """Signal the handler waits for; None is resolved to SIGTERM by validate()."""

    exit_signal_handler_for_dataloader: bool = False
    """With exit_signal_handler and dataset.num_workers > 0: the data workers catch exit_signal too, so a
    signal sent to the whole process group does not end them while the main process saves."""

    manual_gc: bool = False
    """Turn off Python's automatic garbage collector and collect at fixed points on every rank."""

    manual_gc_interval: int = 0
    """With manual_gc: collect every this many iterations (0: only around evaluation)."""

    check_optimizer_step_success: bool = True
    """Check that optimizer.step() succeeded (Megatron Bridge; longspan always stops on non-finite gradients
    unless loss scaling skips the step); False is not supported."""

    skip_sync_grad_norm_across_mp: bool = False
    """Skip the model-parallel reduction of the gradient norm (Megatron Bridge); not supported."""

    iterations_to_skip: list[int] = field(default_factory=list)
    """Iterations to skip, as Megatron-LM counts them: a listed ``i`` skips the iteration that starts after ``i``
    completed iterations (the one logged as ``i + 1``). Its global batch is read and dropped, counted in the
    consumed and skipped samples; nothing is trained, scheduled, logged, evaluated or saved for it."""

    manual_gc_eval: bool = True
    """With manual_gc: collect at the start and end of each evaluation."""

    eval_iters: int = 100
    """Iterations per evaluation of the validation (and test) split."""

    eval_interval: Optional[int] = 1000
    """Evaluate on the validation split every this many iterations; None never evaluates during training."""

    skip_train: bool = False
    """Skip training: only evaluate, then exit."""

    torch_compile: Optional[bool] = None
    """longspan's compiled fast path (not a Megatron field): torch.compile of each transformer layer, applied
    after the parallel plans (longspan.parallel.compile). True compiles, False runs eager, None (default)
    compiles where it pays: on CUDA, on a CPU only where measured to pay (longspan.parallel.compile.CPU_DEFAULT).
    Losses are the same either way (tested with DP, FSDP2, TP/SP, PP, CP, MoE expert parallel and activation
    recompute); a platform that cannot compile runs eager with a one-line note."""


@dataclass
class CheckpointConfig:
    """Saving and loading checkpoints."""

    save: Optional[str] = None
    """Directory checkpoints are saved to; None saves nothing."""

    save_interval: Optional[int] = None
    """Save a checkpoint every this many iterations."""

    save_optim: bool = True
    """Include the optimizer state in saved checkpoints."""

    save_rng: bool = True
    """Include the RNG states in saved checkpoints."""

    load: Optional[str] = None
    """Directory to resume from (its latest checkpoint); a missing directory starts from scratch."""

    load_optim: bool = True
    """Restore the optimizer state when loading."""

    load_main_params_from_ckpt: bool = False
    """With load_optim=False and low-precision params: take the fp32 main params from the checkpoint's saved
    main params (otherwise they are rebuilt from the loaded low-precision weights). Needs load_optim=False."""

    load_rng: bool = True
    """Restore the RNG states when loading."""

    non_persistent_save_interval: Optional[int] = None
    """Iterations between non-persistent checkpoints (an iteration with a persistent save skips it); only the
    newest is kept, and a resume takes the newest complete checkpoint of any kind."""

    non_persistent_ckpt_type: Optional[Literal["global", "local", "in_memory"]] = None
    """Kind of non-persistent checkpoint: 'global' (a torch_dist checkpoint in non_persistent_global_ckpt_dir),
    'local' (each rank torch.saves its own state to non_persistent_local_ckpt_dir); None = none. 'in_memory'
    is not supported yet."""

    non_persistent_global_ckpt_dir: Optional[str] = None
    """Directory of global non-persistent checkpoints; None = {checkpoint.save}/non_persistent."""

    non_persistent_local_ckpt_dir: Optional[str] = None
    """Node-local directory of local non-persistent checkpoints (rank{R}_of{W}/iter_XXXXXXX.pt per rank)."""

    non_persistent_local_ckpt_algo: Literal["fully_parallel", "atomic"] = "fully_parallel"
    """Algorithm of local non-persistent checkpoints; in longspan every rank writes all of its own state
    atomically either way (and, with replication, stores its clique peers' files whole), so both values write
    the same files."""

    finetune: bool = False
    """Load only the model weights and start at iteration 0 (no optimizer or RNG state)."""

    pretrained_checkpoint: Optional[str] = None
    """Checkpoint directory with the pretrained weights to finetune from: a longspan/Megatron checkpoint, or a
    Hugging Face model directory (config.json + safetensors), whose config.json then sets the model
    architecture (the layout and precision fields stay) and whose tokenizer files the tokenizer."""

    also_save_hf_checkpoint: bool = False
    """With every save, also write the model as a Hugging Face directory ``iter_XXXXXXX/hf/`` (config.json +
    safetensors + tokenizer files), gathered one tensor at a time; the architecture is the HF one the run
    started from, else the matching one (Llama for the tiny recipe)."""

    ckpt_step: Optional[int] = None
    """Load this iteration instead of the latest."""

    use_checkpoint_args: bool = False
    """Take the model configuration from the checkpoint's run_config.yaml."""

    exit_on_missing_checkpoint: bool = False
    """With load set: stop with an error when no checkpoint is found instead of starting from scratch."""

    ckpt_format: Literal["torch_dist", "zarr"] = "torch_dist"
    """On-disk format: 'torch_dist' is PyTorch Distributed Checkpoint."""

    ckpt_convert_format: Optional[Literal["torch", "torch_dist", "zarr"]] = None
    """A conversion run: load checkpoint.load, write it in this format to {ckpt_convert_save}/{format} at the
    loaded iteration, and stop without training. longspan writes 'torch_dist' only ('torch' and 'zarr' are
    Megatron's legacy formats)."""

    ckpt_convert_save: Optional[str] = None
    """Directory a conversion run (ckpt_convert_format) writes the converted checkpoint under."""

    fully_parallel_save: bool = True
    """Spread the writing of replicated state across data-parallel ranks. Performance hint in longspan:
    DCP's save planner already writes each replicated tensor once, from one rank."""

    async_save: bool = False
    """Write checkpoints in the background while training continues (torch_dist only)."""

    async_strategy: Literal["nvrx", "mcore"] = "nvrx"
    """Megatron's engine for asynchronous saves (nvidia-resiliency-ext or Megatron Core's own). Performance
    hint in longspan: async_save always runs on DCP's background executor."""

    most_recent_k: Optional[int] = -1
    """Keep only the newest k complete checkpoints under ``save`` (-1 or None: keep all). Older ones are deleted
    after each save completes (for async saves, once the tracker names the new one); the newest and the one
    ``load`` / ``ckpt_step`` points at are never deleted."""

    storage_writers_per_rank: int = 1
    """Storage writers per rank for torch_dist checkpoints: DCP's writer threads, each writing one file of
    the rank's shards (files per checkpoint = saving ranks x this)."""

    strict_fsdp_dtensor_load: bool = False
    """Strict loading of fsdp_dtensor checkpoints (Megatron Bridge); not supported yet."""

    dist_ckpt_optim_fully_reshardable: bool = False
    """Fully reshardable distributed-optimizer checkpoints (Megatron Bridge). No effect in longspan: the
    optimizer state is name-keyed DCP, reshardable across TP/PP/DP layouts whatever this says."""

    distrib_optim_fully_reshardable_mem_efficient: bool = False
    """Memory-efficient variant of dist_ckpt_optim_fully_reshardable (Megatron Bridge). No effect in longspan:
    each rank writes its own shards through DCP without gathering them."""

    save_tokenizer_assets: bool = True
    """Save the tokenizer files into each checkpoint (``tokenizer/``); loading a checkpoint without them uses
    the run's tokenizer config."""

    use_persistent_ckpt_worker: bool = True
    """Keep one background worker for asynchronous saves instead of one per save. Performance hint in
    longspan: async_save runs on DCP's own background executor."""

    fully_parallel_load: bool = False
    """Spread the reading of replicated state across data-parallel ranks. Performance hint in longspan:
    every rank reads what it needs through DCP; the loaded values are the same."""

    ckpt_assume_constant_structure: bool = False
    """The state dict structure never changes during the run: DCP caches the save plan after the first save
    and reuses it (no global planning on later saves)."""

    dist_ckpt_strictness: Literal[
        "assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected", "raise_all",
        "return_unexpected", "return_all", "ignore_all",
    ] = "assume_ok_unexpected"
    """How tensors the checkpoint and the model do not share are handled when loading (megatron-core's
    StrictHandling): 'assume_ok_unexpected' fails on a model tensor the checkpoint lacks; 'log_*' warn, 'raise_*'
    stop with one line, 'return_*' return the keys, 'ignore_all' says nothing; all but 'assume_ok_unexpected' and
    'raise_*' keep the missing tensors' current values ('*_all' also look at checkpoint tensors the model lacks)."""

    replication: bool = False
    """Replicate local non-persistent checkpoints on peer ranks: each rank sends its file to the other ranks of
    its clique, and a rank whose own file is lost gets it back from a peer on resume (non_persistent_ckpt_type
    'local' only)."""

    replication_jump: Optional[int] = None
    """Spacing J between the ranks that hold a rank's replicas (ranks n, n+J, n+2J, ... form a clique); None =
    the ranks per node (LOCAL_WORLD_SIZE), so the replicas are on other nodes."""

    replication_factor: int = 2
    """Number of ranks (the rank itself included) holding a copy of each rank's local checkpoint; J times the
    factor must divide the world size."""

    # Megatron-LM / Megatron Bridge fields newer than the spec (docs/config-support.md gives each one's status).
    save_params_interval: Optional[int] = None
    """Megatron's debug dump of parameter name -> data every this many iterations (None: never)."""

    save_activations_interval: Optional[int] = None
    """Megatron's debug dump of activations every this many iterations (None: never)."""

    save_tokens_per_expert_interval: Optional[int] = None
    """Megatron's dump of the MoE routing's tokens per expert every this many iterations (None: never)."""

    save_wgrads_interval: Optional[int] = None
    """Megatron's debug dump of weight gradients (main_grad) every this many iterations (None: never)."""

    save_dgrads_interval: Optional[int] = None
    """Megatron's debug dump of input gradients every this many iterations (None: never)."""

    save_retain_interval: Optional[int] = None
    """Keep every checkpoint whose iteration is a multiple of this; the others but the newest are deleted."""

    use_mp_args_from_checkpoint_args: bool = False
    """Copy the model-parallel layout from the checkpoint's arguments."""

    use_tokenizer_model_from_checkpoint_args: bool = True
    """With use_checkpoint_args: take the tokenizer model path from the checkpoint's arguments too."""

    auto_detect_ckpt_format: bool = False
    """Detect whether the checkpoint is in Megatron's legacy or distributed format when loading."""

    ckpt_convert_update_legacy_dist_opt_format: bool = False
    """Convert Megatron's pre-2024 distributed-optimizer checkpoint layout when loading."""

    async_ckpt_cpu_priority: int = 10
    """CPU nice value (0-19) of the asynchronous checkpoint writer process."""

    async_ckpt_io_priority: Optional[int] = 3
    """I/O scheduling class (0-3, 3 = idle) of the asynchronous checkpoint writer process."""

    async_ckpt_use_cpu_shm: bool = False
    """Copy device tensors to CPU shared memory before handing them to the asynchronous writer (nvrx strategy)."""

    async_write_results_mp_mode: str = "fork"
    """Start method ('fork', 'spawn', 'forkserver') of the asynchronous writer's results queue."""

    ckpt_fully_parallel_load_exchange_algo: Literal["broadcast", "gather_rounds", "gather_object"] = "broadcast"
    """How Megatron's fully parallel load exchanges the shards it read."""

    ckpt_fully_parallel_load_per_rank_objects: bool = False
    """Megatron's fully parallel load: every rank reads its own non-tensor objects instead of exchanging them."""

    ckpt_fully_parallel_save_process_group: Literal["dp", "ep_dp"] = "dp"
    """Group over which Megatron's fully parallel save splits the writing."""

    ckpt_fully_parallel_load_process_group: Literal["dp", "ep_dp"] = "dp"
    """Group over which Megatron's fully parallel load splits the reading."""

    ckpt_pg_tensors_cache_path: Optional[str] = None
    """Directory of Megatron's cache of the save/load shard distribution (skips a gather at each save)."""

    ckpt_pg_tensors_cache_create: bool = False
    """Write (rather than read) the shard-distribution cache at ckpt_pg_tensors_cache_path."""

    ckpt_load_validate_sharding_integrity: bool = True
    """Check that every shard is read (and written) exactly once as the main replica."""

    dist_ckpt_save_pre_mcore_014: bool = False
    """Save in Megatron Core's checkpoint layout from before version 0.14."""

    verify_integrity: bool = False
    """Hash the checkpoint files at save and verify the hashes at load."""

    custom_manager_class: Optional[str] = None
    """Dotted name of a class implementing Bridge's CheckpointManager protocol, used for every save and load."""

    dist_ckpt_workers: int = 1
    """Worker processes of Megatron's asynchronous distributed-checkpoint save."""

    hf_source_path: Optional[str] = None
    """HF model id or directory used as the template of also_save_hf_checkpoint's export (None: the model's)."""

    hf_trust_remote_code: bool = False
    """Trust the remote code of hf_source_path when building the HF export."""

    hf_distributed_save: bool = False
    """With also_save_hf_checkpoint: several ranks share the writing of the safetensors files."""

    hf_save_every_n_ranks: int = 1
    """With hf_distributed_save: every this-many-th rank writes safetensors shards."""

    def __post_init__(self) -> None:
        """Nothing: checks run in ``ConfigContainer.validate()`` (lazy validation)."""


@dataclass
class LoggerConfig:
    """Console, TensorBoard and experiment-tracker logging."""

    log_interval: int = 100
    """Print the training log line every this many iterations."""

    log_params_norm: bool = False
    """Compute and log the L2 norm of the parameters."""

    log_throughput: bool = False
    """Log TFLOP/s per GPU."""

    log_progress: bool = False
    """Append progress (tokens, FLOPs) to progress.txt in the checkpoint directory."""

    timing_log_level: Literal[0, 1, 2] = 0
    """Which timers are reported: 0 iteration time only, 1 once-per-iteration operations, 2 everything."""

    timing_log_option: Literal["max", "minmax", "all"] = "minmax"
    """How timers are reduced across ranks."""

    tensorboard_dir: Optional[str] = None
    """Directory for TensorBoard event files; None = no TensorBoard."""

    tensorboard_log_interval: int = 1
    """Write TensorBoard scalars every this many iterations."""

    tensorboard_queue_size: int = 1000
    """Pending TensorBoard events before a flush."""

    log_timers_to_tensorboard: bool = False
    """Write timers to TensorBoard."""

    log_loss_scale_to_tensorboard: bool = True
    """Write the loss scale to TensorBoard."""

    log_validation_ppl_to_tensorboard: bool = False
    """Write validation perplexity to TensorBoard."""

    log_memory_to_tensorboard: bool = False
    """Write memory statistics to TensorBoard."""

    log_world_size_to_tensorboard: bool = False
    """Write the world size to TensorBoard."""

    wandb_project: Optional[str] = None
    """Weights & Biases project; None = no W&B."""

    wandb_exp_name: Optional[str] = None
    """Weights & Biases run name."""

    wandb_save_dir: Optional[str] = None
    """Local directory for W&B files."""

    wandb_entity: Optional[str] = None
    """Weights & Biases entity (team or user)."""

    logging_level: Optional[int] = None
    """Level of longspan's loggers (e.g. 20 = INFO); None keeps the default."""

    filter_warnings: bool = True
    """Drop WARNING records of third-party loggers (torch, transformers, ...); longspan's own warnings, which
    are about settings the user made, stay visible."""

    modules_to_filter: Optional[list[str]] = None
    """Logger name prefixes whose records are dropped entirely (e.g. ['torch.distributed'])."""

    set_level_for_all_loggers: bool = False
    """Apply logging_level (INFO when None) to the root and every existing logger, not just longspan's."""

    log_energy: bool = False
    """Log energy per GPU per iteration (J) and power per GPU (W) every log_interval (all ranks' joules over the
    world size), from the platform's counters: NVML (pynvml) or torch.cuda.power_draw on CUDA, RAPL package
    counters under /sys/class/powercap on a Linux CPU. Without a readable counter it is listed at start-up as
    not applicable."""

    # ---- Megatron Bridge 0.2+ fields ------------------------------------------------------------------------
    skip_train_metrics_log: bool = False
    """Skip the per-iteration training metrics: no training log line and nothing sent to any sink
    (validation results are still logged)."""

    log_throughput_to_tensorboard: bool = False
    """Write TFLOP/s per GPU to TensorBoard (and the other sinks)."""

    throughput_window_size: int = 100
    """Wall-clock marks (one per iteration) in the rolling throughput that ``log_throughput_to_tensorboard``
    writes: the average spans the last ``throughput_window_size - 1`` iterations (at least 2)."""

    memory_keys: Optional[dict[str, str]] = None
    """torch.cuda.memory_stats() key -> logged name for log_memory_to_tensorboard and the first memory report
    (None: Megatron's ten allocator statistics); byte counts are logged in gigabytes."""

    log_l2_norm_grad_to_tensorboard: bool = False
    """Write each parameter's gradient L2 norm (l2_norm/grad/NAME) and their global norm to the sinks."""

    log_runtime_to_tensorboard: bool = False
    """Write time/total, time/remaining_estimate, time/tokens, time/samples and time/batches to the sinks."""

    runtime_time_unit: str = "hours"
    """Unit of the runtime metrics: 'seconds', 'minutes', 'hours' or 'days'."""

    mlflow_experiment: Optional[str] = None
    """MLflow experiment name; set it (with mlflow_run_name) to log metrics to MLflow."""

    mlflow_run_name: Optional[str] = None
    """MLflow run name (required with mlflow_experiment)."""

    mlflow_tracking_uri: Optional[str] = None
    """MLflow tracking URI (a server, sqlite:///path/mlflow.db, or a local file store file:///path/mlruns, which
    MLflow 3 opens only with MLFLOW_ALLOW_FILE_STORE=true); None: MLflow's default (MLFLOW_TRACKING_URI)."""

    mlflow_tags: Optional[dict[str, str]] = None
    """Tags set on the MLflow run."""

    comet_project: Optional[str] = None
    """Comet ML project; set it (with comet_experiment_name) to log metrics to Comet. Offline mode follows
    Comet's own settings (COMET_MODE=offline, COMET_OFFLINE_DIRECTORY)."""

    comet_experiment_name: Optional[str] = None
    """Comet ML experiment name (required with comet_project)."""

    comet_workspace: Optional[str] = None
    """Comet ML workspace; None: the API key's default."""

    comet_api_key: Optional[str] = None
    """Comet ML API key; None: COMET_API_KEY from the environment."""

    comet_tags: Optional[list[str]] = None
    """Tags added to the Comet ML experiment."""

    save_config_filepath: Optional[str] = None
    """Write the validated configuration (YAML) to this file at start-up."""

    log_eval_samples: int = 0
    """longspan's own (Megatron Bridge has no such field): at each evaluation, greedily continue the prompts of the
    first N validation samples and log prompt and continuation as text (console, TensorBoard, W&B, MLflow, Comet,
    metrics.jsonl). An SFT sample's prompt is its tokens up to the first answer token; a pretraining sample's is
    its first eval_samples_prompt_tokens tokens. 0: off. Never changes training (greedy, RNG state restored).
    Runs with one process, DDP, FSDP2 and tensor parallelism; pipeline, context, expert and sequence
    parallelism are not supported yet."""

    eval_samples_max_new_tokens: int = 32
    """longspan's own: the most tokens generated per sample of log_eval_samples (stops early at EOS)."""

    eval_samples_prompt_tokens: int = 32
    """longspan's own: prompt length of log_eval_samples for pretraining data (samples without a loss-masked
    prompt); longer SFT prompts keep their last this-many + max_new_tokens tokens where the model's positions end."""

    # Megatron-LM / Megatron Bridge fields newer than the spec (docs/config-support.md gives each one's status).
    log_memory_interval: Optional[int] = None
    """Report memory every this many iterations (None: once, after the first iterations)."""

    log_device_memory_used: bool = False
    """Log the device memory in use as nvidia-smi reports it."""

    log_num_zeros_in_grad: bool = False
    """Megatron-LM's newer place of optimizer.log_num_zeros_in_grad: count and log the zeros in the gradient."""

    log_max_attention_logit: bool = False
    """Log the largest attention logit (QK-clip's statistic) to TensorBoard."""

    barrier_with_L1_time: bool = True
    """Megatron-LM's newer place of model.barrier_with_L1_time: a barrier before level-1 timer measurements."""

    mlflow_description: Optional[str] = None
    """Description of the MLflow run (the UI's Description panel)."""

    mlflow_log_artifacts: bool = True
    """Upload the checkpoint files to MLflow as artifacts after each save."""

    moe_routing_trace_path: Optional[str] = None
    """Directory for JSONL traces of every MoE router's decisions (None: no tracing)."""

    moe_routing_trace_max_training_iters: Optional[int] = None
    """Stop the MoE routing trace after this many training iterations (None: trace them all)."""

    moe_routing_trace_capture_logits: bool = False
    """Record the routers' pre-top-k logits in the MoE routing trace."""

    moe_routing_trace_capture_hidden_states: bool = False
    """Record the routers' input hidden states in the MoE routing trace."""

    moe_routing_trace_dump_weights: bool = False
    """Save the router weights beside the MoE routing trace."""
