"""Run infrastructure configs (Bridge's training.config): RNG, distributed init, rerun state machine, profiling, fault
tolerance and straggler detection."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal, Optional


@dataclass
class RNGConfig:
    """Random number generation."""

    seed: int = 1234
    """Seed for Python, NumPy and PyTorch (CPU and accelerator) random generators."""

    te_rng_tracker: bool = False
    """Use TransformerEngine's RNG tracker (needed for CUDA graphs)."""

    inference_rng_tracker: bool = False
    """Use an RNG tracker configured for inference."""

    data_parallel_random_init: bool = False
    """Give each data-parallel replica different initial weights (seed offset by the data-parallel rank)."""


def _local_rank_from_env() -> int:
    return int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0")))


@dataclass
class DistributedInitConfig:
    """How torch.distributed is initialized."""

    distributed_backend: Literal["nccl", "gloo"] = "nccl"
    """Process-group backend; a CPU-only machine falls back to gloo at start-up."""

    distributed_timeout_minutes: int = 10
    """Timeout of collective operations, in minutes."""

    align_grad_reduce: bool = True
    """With pipeline parallelism: launch every stage's gradient reduction together (False: each stage on its own)."""

    local_rank: int = field(default_factory=_local_rank_from_env)
    """Rank on this node, from the launcher (LOCAL_RANK or SLURM_LOCALID; 0 for a single process)."""

    lazy_init: bool = False
    """Return a function that completes distributed initialization later (for an external DDP manager):
    longspan.training.initialize.initialize_megatron sets up logging, launch, device and layout and returns the
    function that creates the process groups and seeds the generators; turns on model.use_cpu_initialization.
    pretrain()/finetune() create the groups themselves and reject it."""

    use_torch_fsdp2: bool = False
    """Shard parameters, gradients and optimizer state with PyTorch FSDP2 (fully_shard)."""

    nccl_communicator_config_path: Optional[str] = None
    """Megatron's YAML of per-group NCCL settings ({group: {cga_cluster_size, max_ctas, min_ctas}}; groups: tp,
    cp, pp, dp, dp_cp, ...), given to those NCCL groups on CUDA."""

    use_tp_pp_dp_mapping: bool = False
    """Order ranks tp-pp-dp instead of Megatron's default tp-dp-pp (not with expert or context parallelism)."""

    use_gloo_process_groups: bool = True
    """Also create gloo process groups (used for CPU-side collectives)."""

    use_sharp: bool = False
    """Use SHARP for data-parallel collectives: NCCL CollNet on the data-parallel (dp x cp) communicator only
    (CUDA with the nccl backend)."""

    high_priority_stream_groups: Optional[list[str]] = None
    """Groups (tp, cp, pp, dp, dp_cp, ep, ...) whose NCCL kernels run on high-priority CUDA streams."""

    external_gpu_device_mapping: bool = False
    """Device visibility is managed outside (e.g. CUDA_VISIBLE_DEVICES per process): always use device 0."""

    enable_megatron_core_experimental: bool = False
    """Enable Megatron Core's experimental features."""

    # Megatron-LM / Megatron Bridge fields newer than the spec (docs/config-support.md gives each one's status).
    use_megatron_fsdp: bool = False
    """Megatron-FSDP, as ddp.use_megatron_fsdp (Bridge sets both from either): PyTorch FSDP2 runs in its place."""

    lazy_mpu_init: bool = False
    """Megatron-LM's name of lazy_init (Bridge's lazy_init reads and writes it)."""

    sharp_enabled_group: Optional[Literal["dp", "dp_replica"]] = None
    """The one group SHARP is enabled on with use_sharp (None: the data-parallel group)."""

    distributed_timeout_seconds_after_init: Optional[int] = None
    """Timeout in seconds of every process group once the first iteration has completed (None: unchanged)."""

    flight_recorder_dump_path: Optional[str] = None
    """Where NCCL's flight recorder dumps its traces (TORCH_FR_DUMP_TEMP_FILE)."""

    flight_recorder_trace_buffer_size: int = 2000
    """Entries of NCCL's flight recorder buffer (TORCH_NCCL_TRACE_BUFFER_SIZE)."""

    flight_recorder_dump_on_timeout: bool = True
    """Dump the flight recorder's traces on an NCCL timeout (TORCH_NCCL_DUMP_ON_TIMEOUT)."""

    flight_recorder_include_stack_trace: bool = False
    """Include stack traces in the flight recorder's dumps (TORCH_INCLUDE_STACK_TRACE)."""

    flight_recorder_include_only_active: bool = True
    """Dump only the operations still in flight (TORCH_INCLUDE_ONLY_ACTIVE)."""

    flight_recorder_extra_dump_on_exec: bool = True
    """One more flight recorder dump on an execution error (TORCH_NCCL_EXTRA_DUMP_ON_EXEC)."""

    disable_jit_fuser: bool = False
    """Turn off TorchScript's JIT fuser."""

    use_decentralized_pg: bool = False
    """Pass the process groups through the calls instead of a global parallel state."""

    eval_context_parallel_size: Optional[int] = None
    """Context-parallel size of validation when it differs from model.context_parallel_size (needs
    use_decentralized_pg)."""


@dataclass
class RerunStateMachineConfig:
    """The rerun state machine that validates results (NaN/spiky loss checks, re-runs, error injection)."""

    error_injection_rate: int = 0
    """Inject a rejected result about once every this many result validations (0 = never; needs
    rerun_mode='validate_results'); the re-runs then compare as error_injection_type says."""

    error_injection_type: Literal["correct_result", "transient_error", "persistent_error"] = "transient_error"
    """Kind of fault to inject: transient_error (the in-place re-run differs: exit 17), persistent_error or
    correct_result (the in-place re-run matches: exit 16; the re-run on other hardware then differs or matches)."""

    rerun_mode: Literal["disabled", "validate_results", "report_stats"] = "disabled"
    """'validate_results' re-runs an iteration whose loss fails a check in place (same data and RNG): a different
    result exits 17 (transient fault), the same result saves and exits 16 (resume on other hardware to decide);
    'report_stats' runs every iteration twice and logs the variability every logger.log_interval iterations."""

    check_for_nan_in_loss: bool = True
    """Stop with an error when the loss (or gradient) is NaN or infinite (Megatron's check_for_nan_in_loss_and_grad)."""

    check_for_spiky_loss: bool = False
    """Flag a loss >= spiky_loss_factor x the maximum of the first 100 losses (a resilience event; not fatal; with
    validate_results the iteration is also re-run in place)."""

    spiky_loss_factor: float = 10.0
    """A loss this many times the running maximum counts as spiky."""


@dataclass
class ProfilingConfig:
    """Profiling of the training loop."""

    use_nsys_profiler: bool = False
    """Bracket the profiled steps with cudaProfilerStart/Stop for an external nsys run."""

    profile_step_start: int = 10
    """First profiled iteration."""

    profile_step_end: int = 12
    """Iteration where profiling stops."""

    use_pytorch_profiler: bool = False
    """Profile with torch.profiler (TensorBoard trace)."""

    profile_ranks: list[int] = field(default_factory=lambda: [0])
    """Global ranks that profile."""

    record_memory_history: bool = False
    """Record the CUDA allocator's memory history (last rank)."""

    memory_snapshot_path: str = "snapshot.pickle"
    """Where the memory history snapshot is written."""

    record_shapes: bool = False
    """Record tensor shapes in the PyTorch profiler."""

    def __post_init__(self) -> None:
        """Nothing: ``ConfigContainer.validate()`` checks the profiling fields (lazy validation)."""


@dataclass
class FaultToleranceConfig:
    """Fault tolerance: rank heartbeats watched by longspan's launcher (longspan.training.resilience.heartbeat;
    Megatron Bridge uses NVIDIA's nvidia-resiliency-ext package for this)."""

    enable_ft_package: bool = False
    """Each rank heartbeats (start-up, every iteration, checkpoint saves); ``longspan pretrain`` (which then always
    launches workers) kills a rank silent for longer than its timeout (--ft-initial-rank-heartbeat-timeout before
    its first iteration, --ft-rank-heartbeat-timeout after), and the worker group restarts (--max-restarts) and
    resumes from the newest checkpoint."""

    calc_ft_timeouts: bool = False
    """Learn the rank and checkpoint timeouts from observed iteration and save times (5x the longest, at least
    2 s); they are kept in {checkpoint.save}/ft_timeouts.json and a restarted job starts from them."""

    simulate_fault: bool = False
    """Inject a simulated fault in the first run of the job (testing only; needs enable_ft_package)."""

    simulated_fault_type: Literal["rank_hung", "rank_killed", "random"] = "random"
    """Kind of simulated fault: the rank stops itself (SIGSTOP), kills itself (SIGKILL), or one of the two."""

    simulated_fault_rank: Optional[int] = None
    """Rank that fails; None picks one at random."""

    simulated_fault_base_delay: int = 0
    """Seconds after start-up before the simulated fault (plus up to one more, at random)."""


@dataclass
class InProcessRestartConfig:
    """In-process restart (Megatron Bridge's field names; nvidia-resiliency-ext's ``inprocess`` there): when a rank
    fails, ``longspan pretrain``'s own supervisor replaces it while the surviving processes tear down their process
    groups, re-rendezvous with the replacement and resume from the newest checkpoint without restarting
    (longspan.training.resilience.inprocess; docs/resilience.md)."""

    enabled: bool = False
    """Run the workers under longspan's in-process restart supervisor (``longspan pretrain``, one node)."""

    max_iterations: Optional[int] = None
    """Most restarts (worker generations after the first) of the job; one more fault fails it. None: no limit."""

    monitor_thread_interval: float = 1.0
    """Seconds between a worker's checks of the job's generation; a worker still running an older generation is
    interrupted (an exception in its main thread) and restarts in place."""

    monitor_process_interval: float = 1.0
    """Seconds between the supervisor's checks of the worker processes (exits, heartbeats, progress)."""

    progress_watchdog_interval: float = 1.0
    """Seconds between a worker's progress timestamps (written by a watchdog thread while the process runs)."""

    heartbeat_interval: float = 30.0
    """Seconds between a worker's heartbeats (written by its monitor thread)."""

    soft_timeout: float = 60.0
    """Seconds without training progress (a finished iteration, evaluation step or checkpoint save, counted from the
    start of the training loop) after which the rank's monitor thread interrupts it (an exception raised in its
    main thread) and moves the job to the next generation: every rank restarts in place, no process is replaced.
    Must be less than hard_timeout."""

    hard_timeout: float = 90.0
    """Seconds without a progress timestamp after which the supervisor terminates a rank (SIGTERM, then SIGKILL after
    termination_grace_time) and replaces it: a frozen (e.g. SIGSTOPped) process, or one stuck in a call that the
    soft_timeout's exception cannot interrupt. Progress is the training loop's while it runs, the process's
    liveness before and after it."""

    heartbeat_timeout: float = 60.0
    """Seconds without a heartbeat after which the supervisor terminates a rank and replaces it."""

    barrier_timeout: float = 120.0
    """Seconds a worker waits at the re-rendezvous barrier for every rank of its generation (then it fails); also
    the time a starting worker has to write its first heartbeat before the supervisor replaces it."""

    completion_timeout: float = 120.0
    """Seconds the other ranks have to finish once one rank has exited successfully; then the job fails."""

    last_call_wait: float = 1.0
    """Seconds the supervisor waits after a fault for concurrent faults of other ranks, restarting once for all."""

    termination_grace_time: float = 1.0
    """Seconds between SIGTERM and SIGKILL when the supervisor terminates a rank."""

    granularity: Literal["node", "rank"] = "node"
    """What a fault replaces: 'rank': the failed rank's process only (the others restart in place, their processes
    kept); 'node': every process of the failed rank's node (on a one-node job: all workers get new processes)."""

    active_world_size: Optional[int] = None
    """Ranks that run the workload; the other processes of ``--nproc-per-node`` start as warm reserves that wait
    and take a failed rank's place at the next restart, so the workload keeps its world size (the failed process
    becomes a new reserve). None: every process runs the workload."""

    empty_cuda_cache: bool = True
    """Empty the CUDA cache while tearing down before a restart (nothing to do without CUDA)."""

    max_rank_faults: Optional[int] = None
    """Most faults of any one rank; one more fails the job. None: no limit."""

    monitor_process_logdir: Optional[str] = None
    """Directory of the supervisor's own log file (``inprocess_monitor.log``: every fault, restart and exit).
    None: no file."""


@dataclass
class StragglerDetectionConfig:
    """Megatron's straggler detector (slow ranks); longspan.training.resilience.straggler (shared with nvrx_straggler)."""

    log_straggler: bool = False
    """Time each rank's train step and log the best/worst ranks' relative and individual scores every
    logger.log_interval iterations (report only, no thresholds)."""

    enable_straggler_on_startup: bool = True
    """Start with the detector enabled."""

    straggler_ctrlr_port: int = 65535
    """Port that toggles the detector at runtime: rank 0 listens on localhost, and any HTTP request toggles
    detection on every rank at the next logging step; 0 lets the OS choose a free port (logged)."""

    straggler_minmax_count: int = 1
    """How many slowest/fastest ranks to report."""

    disable_straggler_on_startup: bool = False
    """Start with the detector disabled (a request to straggler_ctrlr_port switches it on)."""


@dataclass
class NVRxStragglerDetectionConfig:
    """NVIDIA Resiliency Extension's straggler detection, on longspan's own detector
    (longspan.training.resilience.straggler)."""

    enabled: bool = False
    """Time each rank's train step; every report_time_interval seconds gather the ranks' mean step times, score
    them, log the best/worst ranks, and report ranks under a threshold as stragglers (a resilience event)."""

    report_time_interval: float = 300.0
    """Seconds between straggler checks."""

    calc_relative_gpu_perf: bool = True
    """Compute relative GPU performance scores."""

    calc_individual_gpu_perf: bool = True
    """Compute individual GPU performance scores."""

    num_gpu_perf_scores_to_print: int = 5
    """Best and worst scores to print (0: only when stragglers are found)."""

    gpu_relative_perf_threshold: float = 0.7
    """Relative score below which a GPU is a straggler."""

    gpu_individual_perf_threshold: float = 0.7
    """Individual score below which a GPU is a straggler."""

    stop_if_detected: bool = False
    """End the run cleanly (final checkpoint saved, exit 0) when a straggler is found."""

    enable_logging: bool = True
    """Log the performance scores."""

    profiling_interval: int = 1
    """Profiling interval passed to the detector."""

    logger_name: str = "megatron_hub.NVRxStragglerDetection"
    """Logger that receives the detector's messages."""

    def __post_init__(self) -> None:
        """Nothing: checks run in ``ConfigContainer.validate()``."""
