"""Everything between a validated ConfigContainer and the first iteration.

Order matters for exact resumption: seeds → tokenizer → model → optimizer → scheduler → checkpoint →
data iterators → RNG restore (building iterators draws from torch's generator, so the saved generator
states are applied last).
"""

from __future__ import annotations

import dataclasses
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

from longspan.config.support import inapplicable_fields
from longspan.core.errors import ConfigError
from longspan.core.logging import get_logger, print_rank_0
from longspan.data.loaders import build_train_valid_test_data_iterators, get_train_valid_test_num_samples
from longspan.data.tokenizers import build_tokenizer, model_vocab_size
from longspan.models.builder import build_meta_model
from longspan.models.gpt import apply_deterministic_mode, num_parameters
from longspan.parallel import ParallelState, initialize_distributed
from longspan.parallel.async_tp import enable_async_tensor_parallel
from longspan.parallel.compile import compile_model, cuda_graph_warmup
from longspan.parallel.offload import apply_activation_offload
from longspan.parallel.parallelize import materialize_parallel_model
from longspan.parallel.pipeline import build_pipeline_chunks
from longspan.peft.adapters import init_adapters
from longspan.peft.qlora import quantize_base_weights
from longspan.config.rules.data import check_vocab_fits
from longspan.conversion import is_hf_model_dir
from longspan.training.checkpointing.load import apply_checkpoint_args, find_checkpoint, load_peft_checkpoint
from longspan.training.checkpointing.save import check_save_dir_writable, set_rng_state
from longspan.training.resilience.hooks import (
    build_rerun_state_machine,
    start_fault_tolerance,
    start_straggler_detection,
)
from longspan.training.callbacks import attach_callbacks, fire_event
from longspan.training.initialize import set_random_seed, start_logging
from longspan.training.checkpointing.non_persistent import load_newest_checkpoint
from longspan.training.checkpointing.hf_weights import apply_hf_pretrained_config
from longspan.training.step.microbatches import NumMicroBatchesCalculator
from longspan.training.optim.optimizer import get_megatron_optimizer
from longspan.training.optim.scheduler import get_optimizer_param_scheduler
from longspan.training.resilience.signals import DistributedSignalHandler
from longspan.training.state import GlobalState
from longspan.training.observability.config_logger import log_model_configs
from longspan.training.observability.energy import build_energy_monitor

logger = get_logger(__name__)


@dataclass
class SetupOutput:
    state: GlobalState
    model: list[torch.nn.Module]
    optimizer: Any
    scheduler: Any
    train_data_iterator: Optional[Iterator]
    valid_data_iterator: Optional[Iterator]
    test_data_iterator: Optional[Iterator]
    checkpointing_context: dict[str, Any]


def _autocast_dtype(cfg: Any) -> Optional[torch.dtype]:
    """The torch.autocast dtype of the forward step: model.enable_autocast (mixed_precision.autocast_enabled)
    with model.autocast_dtype (None: the pipeline dtype), else bf16/fp16 for bf16/fp16 models, else none."""
    if cfg.model.enable_autocast:
        return cfg.model.autocast_dtype or cfg.model.pipeline_dtype
    if cfg.model.bf16:
        return torch.bfloat16
    if cfg.model.fp16:
        return torch.float16
    return None


def build_model(
    cfg: Any, parallel: ParallelState, seed: int, pre_wrap_hook: Optional[Callable[[torch.nn.Module], Any]] = None
) -> list[torch.nn.Module]:
    """Build on the meta device, apply the parallel plans, then materialize each parameter from its seed.

    ``pre_wrap_hook(chunk)`` runs on each meta-device chunk before the parallel plans (PEFT adapters)."""
    if parallel.pp_size > 1:
        # Stages are cut first; each chunk then goes through the same materialize step.
        return build_pipeline_chunks(cfg, parallel, seed, pre_wrap_hook)
    return [materialize_parallel_model(build_meta_model(cfg.model), cfg, parallel, seed, pre_wrap_hook)]


def setup(cfg: Any, callbacks: Any = None) -> SetupOutput:
    """Validate, initialize processes, build everything, and load the checkpoint when there is one.

    ``callbacks`` (``training.callbacks``: Callback instances or a manager) become ``state.callback_manager``."""
    state = _initialize(cfg, start_time=time.time())
    attach_callbacks(state, callbacks)
    parallel = state.parallel
    _resolve_and_validate_config(cfg, state)
    _start_run_services(cfg, state)

    set_random_seed(cfg.rng.seed, parallel, cfg.rng.data_parallel_random_init)
    # Weights come from the base seed (per-parameter generators), so every layout draws the same model.
    # Megatron's data_parallel_random_init draws per-replica weights and then broadcasts data-parallel rank 0's,
    # which are these; what stays per replica is the runtime generator seeded above.
    model = build_model(cfg, parallel, cfg.rng.seed, pre_wrap_hook=cfg.peft.apply if cfg.peft is not None else None)
    if cfg.peft is not None:  # adapters drawn from their own streams even when the base is not drawn
        init_adapters(model, cfg.rng.seed)
    log_model_configs(cfg.model, model, parallel)
    # Offloaded layers run eager (validate() rejects torch_compile=True with offload): None resolves to off.
    compile_setting = False if cfg.model.cpu_offloading else cfg.train.torch_compile
    graph_warmup = cuda_graph_warmup(cfg.model, parallel.device)
    state.compiled = compile_model(model, compile_setting, parallel.device, parallel.tp_size, graph_warmup)
    state.cuda_graphs = state.compiled and graph_warmup is not None
    state.activation_offload = apply_activation_offload(model, cfg.model)
    tp_group = parallel.tp_group if parallel.tp_size > 1 else None
    state.async_tensor_parallel = enable_async_tensor_parallel(cfg.model, tp_group, parallel.device, state.compiled)
    optimizer = get_megatron_optimizer(cfg.optimizer, model)
    if parallel.pp_size > 1:
        # Pipeline stages hold different parameters: gradient norms and zero counts sum over the stages.
        optimizer.grad_stats_parallel_group = parallel.pp_group
    scheduler = get_optimizer_param_scheduler(optimizer, cfg.scheduler, cfg.train, cfg.optimizer)

    checkpointing_context: dict[str, Any] = {}
    if cfg.peft is not None:  # the base from pretrained_checkpoint, then this run's adapters when resuming
        loaded = load_peft_checkpoint(state, model, optimizer, scheduler, checkpointing_context=checkpointing_context)
        quantize_base_weights(model, cfg.peft)  # QLoRA: the loaded base to NF4 (again on resume: deterministic)
    else:
        # the newest of checkpoint.load and the non-persistent (global/local) checkpoints
        loaded = load_newest_checkpoint(state, model, optimizer, scheduler, checkpointing_context=checkpointing_context)
    state.train_state_at_start_flops = state.train_state.floating_point_operations_so_far
    state.start_iteration = state.train_state.step
    state.start_consumed_train_samples = state.train_state.consumed_train_samples

    fire_event(state, "on_data_init_start", model, optimizer=optimizer, scheduler=scheduler)
    datasets: list[Any] = []
    train_it, valid_it, test_it = build_train_valid_test_data_iterators(
        cfg, state.train_state, state.tokenizer, dp_rank=parallel.dp_rank, dp_size=parallel.dp_size,
        datasets_out=datasets,
    )
    state.valid_dataset = datasets[1] if datasets else None  # logger.log_eval_samples takes its prompts from it
    train_state = state.train_state
    train_state.do_train = train_it is not None and cfg.train.train_iters > 0
    train_state.do_valid = valid_it is not None and cfg.train.eval_iters > 0
    train_state.do_test = test_it is not None and cfg.train.eval_iters > 0
    if loaded is not None and loaded.rng_state is not None:
        set_rng_state(loaded.rng_state)

    if cfg.train.exit_signal_handler:
        state.signal_handler = DistributedSignalHandler(cfg.train.exit_signal).__enter__()
    _print_banner(cfg, state, model, loaded, datasets)
    return SetupOutput(state, model, optimizer, scheduler, train_it, valid_it, test_it, checkpointing_context)


def _initialize(cfg: Any, start_time: float) -> GlobalState:
    """Logging, then the process group: a ``GlobalState`` holding the config and the parallel state."""
    if cfg.dist.lazy_init:
        raise ConfigError("dist.lazy_init=True defers the process groups to an external manager through "
                          "longspan.training.initialize.initialize_megatron(cfg), which returns the function that "
                          "creates them; pretrain()/finetune() create them at start-up: set dist.lazy_init=false")
    start_logging(cfg)
    parallel = initialize_distributed(cfg.dist, cfg.model, dp_replicate=cfg.ddp.num_distributed_optimizer_instances)
    state = GlobalState()
    state.cfg = cfg
    state.start_time = start_time
    state.parallel = parallel
    state.device = parallel.device
    return state


def _resolve_and_validate_config(cfg: Any, state: GlobalState) -> None:
    """Fill what the config leaves to the checkpoint and the tokenizer, validate it, check the run's outputs."""
    parallel = state.parallel
    if cfg.checkpoint.use_checkpoint_args:
        apply_checkpoint_args(cfg)
    apply_hf_pretrained_config(cfg)  # pretrained_checkpoint = an HF directory: architecture + tokenizer from it
    tokenizer = build_tokenizer(cfg.tokenizer)
    state.tokenizer = tokenizer
    if cfg.model.vocab_size is None:
        cfg.model.vocab_size = model_vocab_size(tokenizer, cfg.tokenizer)
    cfg.validate(world_size=parallel.world_size)
    check_vocab_fits(cfg.model.vocab_size, tokenizer.vocab_size)
    if cfg.logger.save_config_filepath and parallel.rank == 0:
        cfg.to_yaml(cfg.logger.save_config_filepath)
    if cfg.logger.log_energy:  # the platform's energy counters, when this machine exposes any
        state.energy_monitor = build_energy_monitor(parallel.device)
    _report_inapplicable(cfg, no_energy_counters=cfg.logger.log_energy and state.energy_monitor is None)
    state.check_logger_dependencies()
    if cfg.checkpoint.save:
        check_save_dir_writable(cfg.checkpoint.save)


def _start_run_services(cfg: Any, state: GlobalState) -> None:
    """What the step needs besides the model: autocast, NaN checks, rerun/ft/straggler, the microbatch count."""
    state.autocast_dtype = _autocast_dtype(cfg)
    state.check_for_nan = bool(cfg.rerun_state_machine.check_for_nan_in_loss)
    state.rerun_state_machine = build_rerun_state_machine(cfg)  # before loading: checkpoints carry its state
    start_fault_tolerance(state)  # ft: this rank's heartbeat for the launcher's monitor
    start_straggler_detection(state)  # straggler / nvrx_straggler
    state.num_microbatches_calculator = NumMicroBatchesCalculator(
        cfg.train.global_batch_size,
        cfg.train.micro_batch_size,
        cfg.data_parallel_size,
        cfg.train.rampup_batch_size,
        cfg.train.decrease_batch_size_if_needed,
    )
    if cfg.model.deterministic_mode:
        apply_deterministic_mode(cfg.model)


def _report_inapplicable(cfg: Any, no_energy_counters: bool = False) -> None:
    fields = inapplicable_fields(cfg) + (["logger.log_energy=True"] if no_energy_counters else [])
    if fields:
        print_rank_0(f"not applicable on this machine (ignored): {', '.join(fields)}", logger)


def weights_source(cfg: Any, loaded: Any) -> str:
    """Where the run's weights came from, for the start-up banner: "starting from scratch", "weights from HF
    directory D", "weights from pretrained checkpoint D (iteration N)" (both start at iteration 0), or "resuming
    from D at iteration N"; PEFT names its base too. ``loaded``: what the checkpoint loading returned."""
    if cfg.peft is not None:  # the base always comes from pretrained_checkpoint; adapters are new or resumed
        found = find_checkpoint(dataclasses.replace(cfg.checkpoint, load=None))
        base = _weights_origin(*found[:2]) if found is not None else str(cfg.checkpoint.pretrained_checkpoint)
        if loaded is None:
            return f"weights from {base}, new adapters, starting at iteration 0"
        return f"resuming from {loaded.directory} at iteration {loaded.iteration} (base weights from {base})"
    if loaded is None:
        return "starting from scratch"
    if loaded.finetune:
        saved = loaded.saved_iteration if loaded.saved_iteration is not None else loaded.iteration
        return f"weights from {_weights_origin(loaded.directory, saved)}, starting at iteration 0"
    return f"resuming from {loaded.directory} at iteration {loaded.iteration}"


def _weights_origin(directory: Any, iteration: int) -> str:
    if is_hf_model_dir(Path(directory)):
        return f"HF directory {directory}"
    return f"pretrained checkpoint {directory} (iteration {iteration})"


def _print_banner(cfg: Any, state: GlobalState, model: list[torch.nn.Module], loaded: Any,
                  datasets: Optional[list[Any]] = None) -> None:
    parallel = state.parallel
    params = sum(num_parameters(chunk) for chunk in model)
    precision = "bf16 mixed" if cfg.model.bf16 else "fp16 mixed" if cfg.model.fp16 else "fp32"
    if getattr(state, "compiled", False):
        precision += ", compiled layers"
    # a split with no dataset (no test file, do_test off) has no samples, whatever the run would have read
    counts = get_train_valid_test_num_samples(cfg)
    train_n, valid_n, test_n = (n if not datasets or ds is not None else 0 for n, ds in zip(counts, datasets))
    seq = cfg.model.seq_length
    per_sample, sft_line = float(seq), _sft_padding_line(datasets[0] if datasets else None, seq)
    if sft_line is not None:
        per_sample = sft_line[0]
    layout = (
        f"tp={cfg.model.tensor_model_parallel_size} pp={cfg.model.pipeline_model_parallel_size} "
        f"cp={cfg.model.context_parallel_size} dp={cfg.data_parallel_size}"
    )
    print_rank_0(
        f"longspan: {params / 1e6:.2f}M parameters | world size {parallel.world_size} ({layout}) | "
        f"device {parallel.device.type} | {precision} | {weights_source(cfg, loaded)}",
        logger,
    )
    print_rank_0(
        f"longspan: samples train/valid/test {train_n}/{valid_n}/{test_n} "
        f"({'/'.join(_count_text(n * per_sample) for n in (train_n, valid_n, test_n))} "
        f"{'real tokens, estimated' if sft_line is not None else 'tokens'}) | "
        f"global batch {cfg.train.global_batch_size} = {cfg.num_microbatches} microbatches × "
        f"{cfg.train.micro_batch_size} × dp {cfg.data_parallel_size} | "
        f"torch {torch.__version__}, python {platform.python_version()}, pid {os.getpid()}",
        logger,
    )
    if sft_line is not None:
        print_rank_0(sft_line[1], logger)


def _count_text(n: float) -> str:
    """A token count for the start-up line: 0.13M, 12.5k, 768."""
    return f"{n / 1e6:.2f}M" if n >= 1e5 else f"{n / 1e3:.1f}k" if n >= 1e3 else f"{n:.0f}"


def _sft_padding_line(train_ds: Any, seq: int) -> Optional[tuple[float, str]]:
    """(mean real tokens per sample, the start-up line on padding) for unpacked SFT data, from its first 64
    samples; None for other data (packed SFT data fills its packs, pretraining data has no padding)."""
    if train_ds is None or not hasattr(train_ds, "real_lengths"):
        return None
    lengths = train_ds.real_lengths()
    if not lengths:
        return None
    mean = sum(lengths) / len(lengths)
    padded_share = 100.0 * (1.0 - mean / seq) if train_ds.opts.pad_to_max_length else None
    text = (f"longspan: SFT samples: {mean:.0f} real tokens on average (longest {max(lengths)}; the first "
            f"{len(lengths)} training samples) of seq_length={seq}; microbatches {train_ds.padding_text()}")
    if padded_share is not None:
        text += f": about {padded_share:.0f}% of every batch is padding (pack the data to avoid it, see the README)"
    else:
        text += "; throughput and MFU count real tokens only"
    return mean, text
