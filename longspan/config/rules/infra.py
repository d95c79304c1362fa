"""Rules of ``ConfigContainer.validate()`` for the run's infrastructure sections: logger, checkpoint,
resilience (fault tolerance, straggler detection, in-process restart), profiling and distributed initialization.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from longspan.config.rules.resilience import check_resilience_config
from longspan.core.errors import ConfigError, NotSupportedError
from longspan.core.logging import get_logger, print_rank_0

if TYPE_CHECKING:
    from longspan.config.schema.container import ConfigContainer


RUNTIME_TIME_UNITS = ("seconds", "minutes", "hours", "days")

logger = get_logger(__name__)


def check_distributed_init(cfg: "ConfigContainer") -> None:
    """Megatron's companions of two DistributedInitConfig switches: ``lazy_init`` initializes the weights on the
    CPU (``model.use_cpu_initialization``), ``use_sharp`` is an NCCL feature."""
    d = cfg.dist
    if d.lazy_init and hasattr(cfg.model, "use_cpu_initialization") and not cfg.model.use_cpu_initialization:
        cfg.model.use_cpu_initialization = True
        print_rank_0("dist.lazy_init=True: model.use_cpu_initialization set to True (Megatron initializes the "
                     "weights on the CPU before an external manager creates the process groups)", logger)
    if d.use_sharp and d.distributed_backend != "nccl":
        raise ConfigError(f"dist.use_sharp=True is an NCCL feature (CollNet) but dist.distributed_backend="
                          f"{d.distributed_backend!r}: use 'nccl' or set use_sharp=false")


def check_infra(cfg: "ConfigContainer") -> None:
    """Logger, checkpoint, resilience and profiling rules, in that order."""
    check_logger(cfg)
    check_exit_signal_for_dataloader(cfg)
    check_checkpoint(cfg)
    check_resilience_config(cfg)
    check_profiling(cfg)


def check_exit_signal_for_dataloader(cfg: "ConfigContainer") -> None:
    """The data workers catch the exit signal for the main process's handler: without it there is none."""
    if cfg.train.exit_signal_handler_for_dataloader and not cfg.train.exit_signal_handler:
        raise ConfigError("train.exit_signal_handler_for_dataloader=True needs train.exit_signal_handler=True (the "
                          "workers keep running so that the main process can save)")


def check_logger(cfg: "ConfigContainer") -> None:
    """An MLflow or Comet run needs a name; the runtime unit and the memory names must be valid."""
    lg = cfg.logger
    for enabling, naming, client in (("mlflow_experiment", "mlflow_run_name", "MLflow"),
                                     ("comet_project", "comet_experiment_name", "Comet ML")):
        if getattr(lg, enabling, None) and not getattr(lg, naming, None):
            raise ConfigError(f"logger.{enabling}={getattr(lg, enabling)!r} needs logger.{naming}: name the {client} run")
    unit = lg.runtime_time_unit
    if unit not in RUNTIME_TIME_UNITS:
        raise ConfigError(f"logger.runtime_time_unit={unit!r} is not valid: use one of {', '.join(RUNTIME_TIME_UNITS)}")
    keys = lg.memory_keys
    if keys is not None and not (isinstance(keys, dict) and all(isinstance(k, str) and isinstance(v, str)
                                                                   for k, v in keys.items())):
        raise ConfigError(f"logger.memory_keys={keys!r} must map torch.cuda.memory_stats() keys to logged names")
    check_eval_samples_layout(cfg)


def check_eval_samples_layout(cfg: "ConfigContainer") -> None:
    """``logger.log_eval_samples`` runs the whole sequence through the model on every rank (tensor parallel,
    FSDP2 and DDP data parallelism): pipeline, context and expert parallelism, sequence parallelism and
    encoder-decoder models are not supported yet."""
    count = cfg.logger.log_eval_samples
    if not count:
        return
    m = cfg.model
    sharded = [f"model.{name}={getattr(m, name)}" for name in (
        "pipeline_model_parallel_size", "context_parallel_size", "expert_model_parallel_size")
        if (getattr(m, name, 1) or 1) > 1]
    if m.sequence_parallel:
        sharded.append("model.sequence_parallel=True")
    if sharded:
        raise NotSupportedError(
            f"logger.log_eval_samples={count} is not supported yet with {', '.join(sharded)}: sample generation "
            "runs with one process, data parallelism or tensor parallelism; set logger.log_eval_samples=0"
        )
    if hasattr(m, "encoder_num_layers"):
        raise NotSupportedError(f"logger.log_eval_samples={count} is not supported yet for encoder-decoder models "
                                f"({type(m).__name__}); set logger.log_eval_samples=0")


def check_checkpoint(cfg: "ConfigContainer") -> None:
    """Only the torch_dist format; main params from a checkpoint only without its optimizer state."""
    c = cfg.checkpoint
    if c.ckpt_format != "torch_dist":
        # Checkpoints are written by torch.distributed.checkpoint (Megatron's torch_dist layout) only.
        raise NotSupportedError(
            f"checkpoint.ckpt_format={c.ckpt_format!r} is not supported yet by longspan (supported: 'torch_dist', "
            "checkpoints written by torch.distributed.checkpoint)"
        )
    if c.load_main_params_from_ckpt and c.load_optim:
        raise ConfigError("checkpoint.load_main_params_from_ckpt=True needs checkpoint.load_optim=False")
    _check_conversion(c)


def _check_conversion(c: Any) -> None:
    """A conversion run names its target format (torch_dist: the one longspan writes), directory and source."""
    if c.ckpt_convert_format is None:
        if c.ckpt_convert_save is not None:
            raise ConfigError(f"checkpoint.ckpt_convert_save={c.ckpt_convert_save!r} needs "
                              "checkpoint.ckpt_convert_format ('torch_dist')")
        return
    if c.ckpt_convert_format != "torch_dist":
        raise NotSupportedError(
            f"checkpoint.ckpt_convert_format={c.ckpt_convert_format!r} is not supported yet by longspan (supported: "
            "'torch_dist', the format it writes)"
        )
    if not c.ckpt_convert_save:
        raise ConfigError("checkpoint.ckpt_convert_format='torch_dist' needs checkpoint.ckpt_convert_save (the "
                          "directory the converted checkpoint is written to)")
    if not c.load:
        raise ConfigError("checkpoint.ckpt_convert_format='torch_dist' converts checkpoint.load: set it")
    if not c.exit_on_missing_checkpoint:
        c.exit_on_missing_checkpoint = True  # as Megatron: a conversion with nothing to load is an error


def check_profiling(cfg: "ConfigContainer") -> None:
    """One profiler at a time; the profiled steps in order."""
    p = cfg.profiling
    if p is not None:
        if p.use_nsys_profiler and p.use_pytorch_profiler:
            raise ConfigError("profiling.use_nsys_profiler and profiling.use_pytorch_profiler are both True: choose one")
        if p.profile_step_end < p.profile_step_start:
            raise ConfigError(
                f"profiling.profile_step_end={p.profile_step_end} is before "
                f"profiling.profile_step_start={p.profile_step_start}"
            )
