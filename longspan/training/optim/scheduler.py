"""Learning-rate and weight-decay schedule with megatron-core's ``OptimizerParamScheduler`` semantics.

Units are samples: the trainer calls ``step(global_batch_size)`` once per iteration, and every step count
(warmup, decay, WSD annealing, weight-decay increment) is in samples. Formulas: reference §3.

Per-group overrides follow megatron-core 0.16: a param group may carry ``max_lr`` / ``min_lr`` (its own
schedule end points, used for decoupled and scaled learning rates), ``start_wd`` / ``end_wd``, and
``wd_mult`` (multiplies the group's weight decay; 0 for biases and norms). ``lr_mult`` is kept on the
groups for compatibility but, as in megatron-core 0.16, the scheduler does not read it: the optimizer
factory folds it into the group's ``max_lr`` / ``min_lr``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from longspan.config.rules.schedule import (
    LR_DECAY_STYLES,
    SCHEDULER_ARGUMENT_RULES,
    WD_INCR_STYLES,
    WSD_DECAY_STYLES,
)
from longspan.config.schema.optim import OptimizerConfig
from longspan.config.schema.training import SchedulerConfig, TrainingConfig
from longspan.core.errors import ConfigError
from longspan.core.logging import get_logger, print_rank_0
from longspan.training.optim.schedule_resume import ScheduleSource, checkpoint_schedule, choose_schedule

__all__ = ["OptimizerParamScheduler", "get_optimizer_param_scheduler"]

logger = get_logger(__name__)

class OptimizerParamScheduler:
    """Anneals the learning rate and weight decay of every param group of ``optimizer``.

    Args:
        optimizer: anything with ``param_groups`` (a ``MegatronOptimizer`` or a torch optimizer).
        init_lr: learning rate at step 0, where warmup starts.
        max_lr: learning rate at the end of warmup (the peak); groups may override it with ``max_lr``.
        min_lr: learning rate at the end of decay; groups may override it with ``min_lr``.
        lr_warmup_steps: warmup length in samples (< ``lr_decay_steps``).
        lr_decay_steps: step where the decay ends (> 0); after it the rate is ``min_lr``.
        lr_decay_style: one of constant, linear, cosine, inverse-square-root, WSD.
        start_wd: weight decay at step 0.
        end_wd: weight decay at ``wd_incr_steps`` and after (>= ``start_wd``).
        wd_incr_steps: weight-decay increment length in samples.
        wd_incr_style: one of constant (needs start_wd == end_wd), linear, cosine.
        use_checkpoint_opt_param_scheduler: on load, take the checkpoint's values where they differ.
        override_opt_param_scheduler: on load, keep the constructor's values and ignore the checkpoint's.
        wsd_decay_steps: length of WSD's final annealing phase (required for WSD).
        lr_wsd_decay_style: annealing shape for WSD: exponential, linear, cosine, minus_sqrt.
    """

    def __init__(
        self,
        optimizer: Any,
        init_lr: float,
        max_lr: float,
        min_lr: float,
        lr_warmup_steps: int,
        lr_decay_steps: int,
        lr_decay_style: str,
        start_wd: float,
        end_wd: float,
        wd_incr_steps: int,
        wd_incr_style: str,
        use_checkpoint_opt_param_scheduler: bool | None = True,
        override_opt_param_scheduler: bool | None = False,
        wsd_decay_steps: int | None = None,
        lr_wsd_decay_style: str | None = None,
    ) -> None:
        self.optimizer = optimizer
        self.init_lr = init_lr
        self.max_lr = max_lr
        self.min_lr = min_lr
        self.lr_warmup_steps = lr_warmup_steps
        self.lr_decay_steps = lr_decay_steps
        self.lr_decay_style = lr_decay_style
        self.wsd_decay_steps = wsd_decay_steps
        self.lr_wsd_decay_style = lr_wsd_decay_style
        self.start_wd = start_wd
        self.end_wd = end_wd
        self.wd_incr_steps = wd_incr_steps
        self.wd_incr_style = wd_incr_style
        self.override_opt_param_scheduler = override_opt_param_scheduler
        self.use_checkpoint_opt_param_scheduler = use_checkpoint_opt_param_scheduler
        for _name, rule in SCHEDULER_ARGUMENT_RULES:
            rule(self)
        self.max_lr = float(max_lr)
        self.num_steps = 0
        # The config fields and units behind these values (get_optimizer_param_scheduler sets it), so that a
        # resume speaks in the user's terms and can tell a longer run from a changed schedule.
        self.source: ScheduleSource | None = None

        # Write the step-0 values into the param groups right away, as megatron-core does.
        self.step(0)
        print_rank_0(f"> learning rate decay style: {self.lr_decay_style}", logger)

    # ------------------------------------------------------------------ schedule
    def get_wd(self, param_group: dict | None = None) -> float:
        """Weight decay at the current step (before the group's ``wd_mult``).

        A group's ``start_wd`` / ``end_wd`` keys, when present, replace the scheduler's end points.
        """
        start_wd = self.start_wd if param_group is None else param_group.get("start_wd", self.start_wd)
        end_wd = self.end_wd if param_group is None else param_group.get("end_wd", self.end_wd)

        if self.num_steps > self.wd_incr_steps:
            return end_wd
        if self.wd_incr_style == "constant":
            if start_wd != end_wd:
                raise ConfigError(
                    f"weight_decay_incr_style='constant' needs equal start and end weight decay, got "
                    f"{start_wd} and {end_wd} (param group overrides included); use 'linear' or 'cosine'"
                )
            return end_wd

        progress = float(self.num_steps) / float(self.wd_incr_steps)
        if self.wd_incr_style == "linear":
            coeff = progress
        elif self.wd_incr_style == "cosine":
            # Rises from 0 to 1 along the second half of a cosine period.
            coeff = 0.5 * (math.cos(math.pi * (1.0 - progress)) + 1.0)
        else:
            raise ConfigError(
                f"scheduler.weight_decay_incr_style={self.wd_incr_style!r} is invalid: valid styles are "
                f"{list(WD_INCR_STYLES)}"
            )
        return start_wd + coeff * (end_wd - start_wd)

    def get_lr(self, param_group: dict) -> float:
        """Learning rate of ``param_group`` at the current step (its ``max_lr`` / ``min_lr`` if present)."""
        max_lr = param_group.get("max_lr", self.max_lr)
        min_lr = param_group.get("min_lr", self.min_lr)
        n = self.num_steps
        warmup = self.lr_warmup_steps

        if warmup > 0 and n <= warmup:
            return self.init_lr + (max_lr - self.init_lr) * float(n) / float(warmup)

        if self.lr_decay_style == "constant":
            return max_lr

        if n > self.lr_decay_steps:
            return min_lr

        if self.lr_decay_style == "inverse-square-root":
            # Continuous with the warmup peak: max_lr at n == warmup, then ~ 1/sqrt(n).
            lr = max_lr * math.sqrt(max(warmup, 1)) / math.sqrt(max(n, 1))
            return max(min_lr, lr)

        ratio = float(n - warmup) / float(self.lr_decay_steps - warmup)
        if self.lr_decay_style == "linear":
            coeff = 1.0 - ratio
        elif self.lr_decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        elif self.lr_decay_style == "WSD":
            anneal_start = self.lr_decay_steps - self.wsd_decay_steps
            if n <= anneal_start:
                coeff = 1.0
            else:
                wsd_ratio = float(n - anneal_start) / float(self.wsd_decay_steps)
                coeff = _wsd_coeff(self.lr_wsd_decay_style, wsd_ratio)
        else:
            raise ConfigError(
                f"scheduler.lr_decay_style={self.lr_decay_style!r} is invalid: valid styles are "
                f"{list(LR_DECAY_STYLES)}"
            )
        return min_lr + coeff * (max_lr - min_lr)

    def step(self, increment: int) -> None:
        """Advance by ``increment`` samples and write ``lr`` and ``weight_decay`` into every param group."""
        self.num_steps += increment
        # Empty groups get values too: the logged learning rate may be read from one.
        for param_group in self.optimizer.param_groups:
            param_group["lr"] = self.get_lr(param_group)
            param_group["weight_decay"] = self.get_wd(param_group) * param_group.get("wd_mult", 1.0)

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """megatron-core's keys, so checkpoints are interchangeable in meaning."""
        return {
            "max_lr": self.max_lr,
            "lr_warmup_steps": self.lr_warmup_steps,
            "num_steps": self.num_steps,
            "lr_decay_style": self.lr_decay_style,
            "lr_decay_steps": self.lr_decay_steps,
            "min_lr": self.min_lr,
            "start_wd": self.start_wd,
            "end_wd": self.end_wd,
            "wd_incr_style": self.wd_incr_style,
            "wd_incr_steps": self.wd_incr_steps,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the schedule position and end points (old Megatron key names are accepted too).

        Which end points a resumed run follows (the config's, the checkpoint's, or an error) is
        ``schedule_resume.choose_schedule``'s decision: Megatron's two switches, and a changed run length.
        """
        checkpoint = checkpoint_schedule(state_dict)
        chosen, line = choose_schedule(self, checkpoint)
        for key in ("max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style"):
            setattr(self, key, chosen[key])
        # Megatron adds the checkpoint's count to the current one (0 for a fresh scheduler) and, like it,
        # applies the new lr before the weight-decay end points below are restored.
        self.step(increment=checkpoint["num_steps"])
        for key in ("start_wd", "end_wd", "wd_incr_steps", "wd_incr_style"):
            if key in chosen:
                setattr(self, key, chosen[key])
        if line is not None:
            print_rank_0(line, logger)


def _wsd_coeff(style: str | None, ratio: float) -> float:
    """Fraction of (max_lr - min_lr) left after ``ratio`` of WSD's annealing phase."""
    if style == "linear":
        return 1.0 - ratio
    if style == "cosine":
        return 0.5 * (math.cos(math.pi * ratio) + 1.0)
    if style == "exponential":
        return 2.0 * math.pow(0.5, ratio) - 1.0
    if style == "minus_sqrt":
        return 1.0 - math.sqrt(ratio)
    raise ConfigError(
        f"scheduler.lr_wsd_decay_style={style!r} is invalid: valid styles are {list(WSD_DECAY_STYLES)}"
    )


def get_optimizer_param_scheduler(
    optimizer: Any, scheduler_cfg: SchedulerConfig, train_cfg: TrainingConfig, optimizer_cfg: OptimizerConfig
) -> OptimizerParamScheduler:
    """Build the scheduler from longspan's ``SchedulerConfig``, ``TrainingConfig`` and ``OptimizerConfig``.

    The step counts come from the scheduler config's derived fields (``lr_warmup_steps``,
    ``lr_decay_steps``, ``wd_incr_steps``, ``wsd_decay_steps``, set by ``ConfigContainer.validate()``); any
    left at None are derived here the same way from ``train_iters`` (or ``train_samples``) and
    ``global_batch_size``. ``start_weight_decay`` / ``end_weight_decay`` default to
    ``optimizer.weight_decay``, as Megatron Bridge does.
    """
    steps = _derive_steps(scheduler_cfg, train_cfg)
    weight_decay = optimizer_cfg.weight_decay
    start_wd = scheduler_cfg.start_weight_decay
    end_wd = scheduler_cfg.end_weight_decay
    start_wd = weight_decay if start_wd is None else start_wd
    end_wd = weight_decay if end_wd is None else end_wd
    max_lr = optimizer_cfg.lr
    if max_lr is None:
        raise ConfigError("optimizer.lr=None is invalid: set the peak learning rate, e.g. optimizer.lr=3e-4")
    min_lr = optimizer_cfg.min_lr
    min_lr = 0.0 if min_lr is None else min_lr

    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=scheduler_cfg.lr_warmup_init,
        max_lr=max_lr,
        min_lr=min_lr,
        lr_warmup_steps=steps["lr_warmup_steps"],
        lr_decay_steps=steps["lr_decay_steps"],
        lr_decay_style=scheduler_cfg.lr_decay_style,
        start_wd=start_wd,
        end_wd=end_wd,
        wd_incr_steps=steps["wd_incr_steps"],
        wd_incr_style=scheduler_cfg.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=scheduler_cfg.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=scheduler_cfg.override_opt_param_scheduler,
        wsd_decay_steps=steps["wsd_decay_steps"],
        lr_wsd_decay_style=scheduler_cfg.lr_wsd_decay_style,
    )
    scheduler.source = _schedule_source(scheduler_cfg, train_cfg)
    return scheduler


def _schedule_source(scheduler_cfg: SchedulerConfig, train_cfg: TrainingConfig) -> ScheduleSource:
    """The config fields behind the schedule, in the unit the run is given in."""
    by_samples = train_cfg.train_samples is not None
    unit_word = "samples" if by_samples else "iters"
    length_field = "train.train_samples" if by_samples else "train.train_iters"
    if scheduler_cfg.lr_warmup_fraction is not None:
        warmup = "scheduler.lr_warmup_fraction"
    else:
        warmup = f"scheduler.lr_warmup_{unit_word}"
    decay_set = (scheduler_cfg.lr_decay_samples if by_samples else scheduler_cfg.lr_decay_iters) is not None
    decay = f"scheduler.lr_decay_{unit_word}" + ("" if decay_set else f", default {length_field}")

    def steps_for_length(length: int) -> dict[str, Any]:
        cleared = dataclasses.replace(scheduler_cfg)  # the derived step counts are left unset: recomputed
        if by_samples:
            train = dataclasses.replace(train_cfg, train_samples=length, train_iters=None)
        else:
            train = dataclasses.replace(train_cfg, train_iters=length, train_samples=None)
        return _derive_steps(cleared, train)

    return ScheduleSource(
        unit="samples" if by_samples else "iterations",
        samples_per_unit=1 if by_samples else int(train_cfg.global_batch_size or 1),
        length_field=length_field,
        length=int(train_cfg.train_samples if by_samples else train_cfg.train_iters or 0),
        fields={"max_lr": "optimizer.lr", "min_lr": "optimizer.min_lr", "lr_warmup_steps": warmup,
                "lr_decay_steps": decay, "lr_decay_style": "scheduler.lr_decay_style",
                "start_wd": "scheduler.start_weight_decay", "end_wd": "scheduler.end_weight_decay",
                "wd_incr_steps": length_field, "wd_incr_style": "scheduler.weight_decay_incr_style"},
        steps_for_length=steps_for_length,
    )


def _derive_steps(scheduler_cfg: SchedulerConfig, train_cfg: TrainingConfig) -> dict[str, Any]:
    """Step counts in samples: the config's derived values, else Megatron's iteration/sample formulas."""
    steps = {
        "lr_warmup_steps": scheduler_cfg.lr_warmup_steps,
        "lr_decay_steps": scheduler_cfg.lr_decay_steps,
        "wd_incr_steps": scheduler_cfg.wd_incr_steps,
        "wsd_decay_steps": scheduler_cfg.wsd_decay_steps,
    }
    if steps["lr_decay_steps"] is not None and steps["wd_incr_steps"] is not None:
        if steps["lr_warmup_steps"] is None:
            steps["lr_warmup_steps"] = 0
        return steps

    gbs = train_cfg.global_batch_size
    train_iters = train_cfg.train_iters
    train_samples = train_cfg.train_samples
    decay_iters = scheduler_cfg.lr_decay_iters
    warmup_fraction = scheduler_cfg.lr_warmup_fraction
    warmup_iters = scheduler_cfg.lr_warmup_iters or 0
    wsd_iters = scheduler_cfg.lr_wsd_decay_iters

    if train_iters:
        if gbs is None:
            raise ConfigError("train.global_batch_size=None is invalid: the schedule needs a global batch size")
        decay_steps = (decay_iters if decay_iters is not None else train_iters) * gbs
        derived = {
            "lr_decay_steps": decay_steps,
            "wd_incr_steps": train_iters * gbs,
            "wsd_decay_steps": wsd_iters * gbs if wsd_iters is not None else None,
            "lr_warmup_steps": (
                warmup_fraction * decay_steps if warmup_fraction is not None else warmup_iters * gbs
            ),
        }
    elif train_samples:
        # Sample-based: the *_samples fields, as validate() reads them; the iteration fields, when those are
        # unset, are read as sample counts, as in Megatron.
        s = scheduler_cfg
        decay_samples = s.lr_decay_samples if s.lr_decay_samples is not None else decay_iters
        decay_steps = decay_samples if decay_samples is not None else train_samples
        warmup_samples = s.lr_warmup_samples or warmup_iters
        derived = {
            "lr_decay_steps": decay_steps,
            "wd_incr_steps": train_samples,
            "wsd_decay_steps": s.lr_wsd_decay_samples if s.lr_wsd_decay_samples is not None else wsd_iters,
            "lr_warmup_steps": warmup_fraction * decay_steps if warmup_fraction is not None else warmup_samples,
        }
    else:
        raise ConfigError(
            "train.train_iters=None and train.train_samples=None: set one of them so the learning-rate "
            "schedule has a length"
        )
    return {name: steps[name] if steps[name] is not None else derived[name] for name in steps}
