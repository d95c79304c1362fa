"""Training state: ``TrainState`` (what a checkpoint must restore) and ``GlobalState`` (everything else a
run carries around: config, timers, metric sinks, tokenizer, signal handler).

``GlobalState`` replaces Megatron's global variables. It imports only the config, ``core`` and torch: the
trainer, checkpointing and data code hand it what they build (``tokenizer``, ``signal_handler``,
``rerun_state_machine``, ``num_microbatches_calculator``). Construction is cheap; timers and metric sinks
are created on first use, and sinks only on the last rank (Megatron's logging rank).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields
from typing import Any, Optional

import torch
from torch.distributed.checkpoint.stateful import Stateful

from longspan.config.schema.container import ConfigContainer
from longspan.core.logging import get_rank, get_world_size
from longspan.training.observability import loggers as _loggers
from longspan.training.observability.timers import Timers


@dataclass
class TrainState(Stateful):
    """Progress of the training run; saved in every checkpoint (``train_state.pt`` and DCP).

    Attributes:
        step: iterations completed.
        consumed_train_samples: training samples consumed so far (drives the data samplers and schedule).
        skipped_train_samples: samples skipped (e.g. by the rerun machinery) rather than trained on.
        consumed_valid_samples: validation samples consumed so far.
        floating_point_operations_so_far: model FLOPs done so far (for TFLOP/s and progress.txt).
        do_train: whether the run trains (a training split exists and ``train_iters > 0``).
        do_valid: whether a validation split exists.
        do_test: whether a test split exists.
    """

    step: int = 0
    consumed_train_samples: int = 0
    skipped_train_samples: int = 0
    consumed_valid_samples: int = 0
    floating_point_operations_so_far: float = 0.0
    do_train: bool = False
    do_valid: bool = False
    do_test: bool = False

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The fields as 0-d CPU tensors (int64 counters, float64 FLOPs, bool flags).

        Tensors (rather than Python scalars) let DCP store them as ordinary tensor entries; int64 keeps
        sample counters safe past 2**31.
        """
        return {
            "step": torch.tensor(self.step, dtype=torch.int64),
            "consumed_train_samples": torch.tensor(self.consumed_train_samples, dtype=torch.int64),
            "skipped_train_samples": torch.tensor(self.skipped_train_samples, dtype=torch.int64),
            "consumed_valid_samples": torch.tensor(self.consumed_valid_samples, dtype=torch.int64),
            "floating_point_operations_so_far": torch.tensor(
                float(self.floating_point_operations_so_far), dtype=torch.float64
            ),
            "do_train": torch.tensor(bool(self.do_train), dtype=torch.bool),
            "do_valid": torch.tensor(bool(self.do_valid), dtype=torch.bool),
            "do_test": torch.tensor(bool(self.do_test), dtype=torch.bool),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from ``state_dict``; values may be tensors or Python scalars. Missing keys keep defaults."""
        for f in fields(self):
            if f.name not in state_dict:
                continue
            value = state_dict[f.name]
            if isinstance(value, torch.Tensor):
                value = value.item()
            if f.name == "floating_point_operations_so_far":
                value = float(value)
            elif f.name.startswith("do_"):
                value = bool(value)
            else:
                value = int(value)
            setattr(self, f.name, value)


class GlobalState:
    """Everything a run shares: config, train state, timers, metric sinks and helpers others attach.

    Args:
        cfg: the run's ``ConfigContainer`` (may also be set later through ``state.cfg = cfg``).

    Attributes set by other parts (plain attributes, None until set):
        tokenizer: the tokenizer built by the data layer.
        signal_handler: the exit-signal handler installed by the trainer.
        rerun_state_machine: the rerun state machine (configured by RerunStateMachineConfig).
        num_microbatches_calculator: an object with ``get_current_global_batch_size()`` and
            ``get()`` (megatron-core's calculator API) when batch-size ramp-up is in use; the training log
            reads the current global batch size from it.
        energy_monitor: an object with ``lap() -> joules`` when ``logger.log_energy`` is honoured.
        valid_dataset: the validation dataset (indexable), where ``logger.log_eval_samples`` takes its prompts.
        callback_manager: the run's ``training.callbacks.CallbackManager`` (None without callbacks).
        start_time: ``time.time()`` when the state was created (the trainer may reset it).
    """

    def __init__(self, cfg: Optional[ConfigContainer] = None) -> None:
        self._cfg: Optional[ConfigContainer] = cfg
        self._train_state: Optional[TrainState] = None
        self._timers: Optional[Timers] = None
        # Sinks: "unset" until first access so a None result (disabled) is cached too.
        self._sinks: dict[str, Any] = {}
        self.tokenizer: Optional[Any] = None
        self.signal_handler: Optional[Any] = None
        self.rerun_state_machine: Optional[Any] = None
        self.num_microbatches_calculator: Optional[Any] = None
        self.energy_monitor: Optional[Any] = None
        self.valid_dataset: Optional[Any] = None
        self.callback_manager: Optional[Any] = None
        self.start_time: float = time.time()
        self._run: Optional[_loggers.RunIdentity] = None
        # Where this run's training starts (after loading a checkpoint): the summary reports this run's part.
        self.start_iteration: int = 0
        self.start_consumed_train_samples: int = 0
        # Running FLOPs total at the last training-log line (for TFLOP/s over the interval).
        self._flops_at_last_log: Optional[float] = None
        self._reset_token_counts()

    # ------------------------------------------------------------------ config and train state
    @property
    def cfg(self) -> Optional[ConfigContainer]:
        """The run's ``ConfigContainer``."""
        return self._cfg

    @cfg.setter
    def cfg(self, value: Optional[ConfigContainer]) -> None:
        self._cfg = value
        self._run = None  # named after the new config's directories

    @property
    def train_state(self) -> TrainState:
        """The run's ``TrainState`` (a fresh one on first access)."""
        if self._train_state is None:
            self._train_state = TrainState()
        return self._train_state

    @train_state.setter
    def train_state(self, value: TrainState) -> None:
        self._train_state = value

    # ------------------------------------------------------------------ timers
    @property
    def timers(self) -> Timers:
        """``Timers`` for ``logger.timing_log_level`` / ``logger.timing_log_option`` (created on first use)."""
        if self._timers is None:
            logger_cfg = self._cfg.logger if self._cfg is not None else None
            if logger_cfg is None:  # timers before the config is set (or without a logger section): the defaults
                self._timers = Timers(0, "minmax")
            else:
                self._timers = Timers(logger_cfg.timing_log_level, logger_cfg.timing_log_option)
        return self._timers

    # ------------------------------------------------------------------ metric sinks (last rank only)
    def _sink(self, name: str, build: Any) -> Optional[Any]:
        if self._cfg is None:
            return None  # not cached: the sink is built once a config is set
        if name not in self._sinks:
            self._sinks[name] = build() if get_rank() == get_world_size() - 1 else None
        return self._sinks[name]

    @property
    def run(self) -> Optional[_loggers.RunIdentity]:
        """The run's name (its directory's) and this launch's id, which every sink records; None without a config."""
        if self._cfg is None:
            return None
        if self._run is None:
            self._run = _loggers.run_identity(self._cfg, self.start_time)
        return self._run

    @property
    def tensorboard_logger(self) -> Optional[Any]:
        """A TensorBoard ``SummaryWriter`` on the last rank when ``logger.tensorboard_dir`` is set, else None."""
        return self._sink("tensorboard", lambda: _loggers.build_tensorboard_writer(
            self._cfg.logger, self.run, self.start_iteration))

    @property
    def wandb_logger(self) -> Optional[Any]:
        """The initialized ``wandb`` module on the last rank when ``logger.wandb_project`` is set, else None.

        Raises ConfigError when W&B is configured but not installed.
        """
        return self._sink("wandb", lambda: _loggers.build_wandb_logger(self._cfg, self.run))

    @property
    def mlflow_logger(self) -> Optional[Any]:
        """The ``mlflow`` module with an active run when ``logger.mlflow_experiment`` is set, else None."""
        return self._sink("mlflow", lambda: _loggers.build_mlflow_logger(self._cfg, self.run))

    @property
    def comet_logger(self) -> Optional[Any]:
        """A Comet experiment when ``logger.comet_project`` is set, else None."""
        return self._sink("comet", lambda: _loggers.build_comet_logger(self._cfg, self.run))

    @property
    def metrics_logger(self) -> Optional[_loggers.MetricsJSONLWriter]:
        """JSON-lines writer (one object per iteration) on the last rank, or None when disabled.

        The file is ``metrics.jsonl`` in ``logger.tensorboard_dir``, else in ``checkpoint.save``.
        """

        def build() -> Optional[_loggers.MetricsJSONLWriter]:
            path = _loggers.metrics_jsonl_path(self._cfg)
            return _loggers.MetricsJSONLWriter(path, self.run) if path else None

        return self._sink("metrics", build)

    def check_logger_dependencies(self) -> None:
        """Fail fast (ConfigError) when a configured optional logger's client library is missing."""
        if self._cfg is not None:
            _loggers.check_logger_dependencies(self._cfg.logger)

    # ------------------------------------------------------------------ lifecycle
    def flush_loggers(self) -> None:
        """Flush TensorBoard and the JSON-lines file (those already created)."""
        for name in ("tensorboard", "metrics"):
            sink = self._sinks.get(name)
            if sink is not None:
                sink.flush()

    def close_loggers(self) -> None:
        """Flush and close every sink created so far; a later access creates them again."""
        tb = self._sinks.get("tensorboard")
        if tb is not None:
            tb.close()
        metrics = self._sinks.get("metrics")
        if metrics is not None:
            metrics.close()
        wandb = self._sinks.get("wandb")
        if wandb is not None:
            wandb.finish()
        mlflow = self._sinks.get("mlflow")
        if mlflow is not None:
            mlflow.end_run()
        comet = self._sinks.get("comet")
        if comet is not None:
            comet.end()
        self._sinks.clear()

    def _reset_token_counts(self) -> None:
        """This run's real-token counts (longspan.training.real_tokens): the counter on the training iterator,
        the last step's (real tokens, Σ length², positions), the run's totals, the total at the last log, and the
        total at the end of each recent iteration (beside the loop's wall-clock marks, for the throughput window)."""
        self.real_token_counter: Optional[Any] = None
        self.last_token_counts: Optional[tuple[int, int, int]] = None
        self.last_step_tokens: Optional[int] = None
        self.last_step_flops: Optional[float] = None
        self.real_tokens_so_far: int = 0
        self.positions_so_far: int = 0
        self._tokens_at_last_log: int = 0
        self.real_token_marks: list[int] = []

    def reset_for_restart(self) -> None:
        """Drop timers, train state and sinks so an in-process restart starts clean."""
        self.close_loggers()
        self._timers = None
        self._train_state = None
        self.signal_handler = None
        self._flops_at_last_log = None
        self._reset_token_counts()
        self.start_time = time.time()
        self._run = None
