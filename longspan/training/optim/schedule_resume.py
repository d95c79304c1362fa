"""Resuming a learning-rate schedule: which of the config's and the checkpoint's values a resumed run follows.

Megatron's rule (``OptimizerParamScheduler._check_and_set``): ``scheduler.override_opt_param_scheduler`` takes
the config's values, ``scheduler.use_checkpoint_opt_param_scheduler`` the checkpoint's, and with neither the two
must agree. One difference is expected rather than a conflict: a run continued with another length
(``train.train_iters=400`` after a finished 200-iteration run). The schedule is a function of the config, so
when every difference is what the length alone changes (a decay that defaults to the run's length, a warmup
given as ``lr_warmup_fraction`` of it, the weight-decay increment), the config's schedule is followed and one
line says so. Any other difference is an error that names the fields in the units the config gives them in
(iterations or samples) and both switches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

from longspan.core.errors import CheckpointError

__all__ = ["ScheduleSource", "checkpoint_schedule", "choose_schedule"]

# the schedule's end points as megatron-core's state dict names them, in its order
LR_KEYS = ("max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style")
WD_KEYS = ("start_wd", "end_wd", "wd_incr_steps", "wd_incr_style")
LENGTH_KEYS = ("lr_warmup_steps", "lr_decay_steps", "wd_incr_steps")
_LABELS = {
    "max_lr": "peak learning rate", "min_lr": "minimum learning rate", "lr_warmup_steps": "warmup",
    "lr_decay_steps": "decay length", "lr_decay_style": "decay style", "start_wd": "start weight decay",
    "end_wd": "end weight decay", "wd_incr_steps": "weight-decay increment length",
    "wd_incr_style": "weight-decay increment style",
}
OVERRIDE = "scheduler.override_opt_param_scheduler=true"
USE_CHECKPOINT = "scheduler.use_checkpoint_opt_param_scheduler=true"


@dataclass(frozen=True)
class ScheduleSource:
    """Where a scheduler's values come from in the config, so that a resume can speak in the user's terms."""

    unit: str
    """``iterations`` (train.train_iters runs) or ``samples`` (train.train_samples runs)."""

    samples_per_unit: int
    """The global batch size for iteration-based runs, 1 for sample-based ones."""

    length_field: str
    """``train.train_iters`` or ``train.train_samples``."""

    length: int
    """This config's run length, in ``unit``."""

    fields: dict[str, str]
    """Scheduler state key -> the config field that sets it (``lr_warmup_steps`` -> ``scheduler.lr_warmup_fraction``)."""

    steps_for_length: Callable[[int], dict[str, Any]]
    """The config's warmup/decay/weight-decay lengths (samples) had the run been this many units long."""


def checkpoint_schedule(state_dict: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's schedule under megatron-core's current names (older Megatron names are accepted)."""
    values = {
        "max_lr": state_dict["start_lr"] if "start_lr" in state_dict else state_dict["max_lr"],
        "min_lr": state_dict["min_lr"],
        "lr_warmup_steps": _first_key(state_dict, "warmup_iter", "warmup_steps", "lr_warmup_steps"),
        "lr_decay_steps": _first_key(state_dict, "end_iter", "decay_steps", "lr_decay_steps"),
        "lr_decay_style": _first_key(state_dict, "decay_style", "lr_decay_style"),
        "num_steps": _first_key(state_dict, "num_iters", "num_steps"),
    }
    if "start_wd" in state_dict:
        values.update({key: state_dict[key] for key in WD_KEYS})
    return values


def choose_schedule(scheduler: Any, checkpoint: dict[str, Any]) -> tuple[dict[str, Any], Optional[str]]:
    """The values the resumed ``scheduler`` follows, and the one line to log about them (None: nothing to say).

    Raises ``CheckpointError`` when the two differ and neither switch nor a change of run length explains it.
    """
    keys = [key for key in (*LR_KEYS, *WD_KEYS) if key in checkpoint]
    config = {key: getattr(scheduler, key) for key in keys}
    differ = [key for key in keys if not _same(config[key], checkpoint[key])]
    source: Optional[ScheduleSource] = getattr(scheduler, "source", None)
    if not differ:
        return dict(checkpoint), None
    if scheduler.override_opt_param_scheduler:
        return config, f"> learning-rate schedule: following this config ({OVERRIDE}): " + _changes(
            differ, config, checkpoint, source, "the checkpoint's")
    if scheduler.use_checkpoint_opt_param_scheduler:
        return dict(checkpoint), f"> learning-rate schedule: keeping the checkpoint's ({USE_CHECKPOINT}): " + \
            _changes(differ, checkpoint, config, source, "this config's")
    old_length = _length_change(differ, checkpoint, source)
    if old_length is not None:
        return config, (
            f"> {source.length_field}={source.length}, the checkpoint's schedule was for {old_length}: the learning-"
            f"rate schedule follows this config ({_describe_lengths(config, source)}); {USE_CHECKPOINT} keeps the "
            "checkpoint's")
    raise CheckpointError(
        _changes(differ, config, checkpoint, source, "the checkpoint's", conflict=True)
        + f"; set {OVERRIDE} to follow this config or {USE_CHECKPOINT} to keep the checkpoint's")


def _length_change(differ: list[str], checkpoint: dict[str, Any], source: Optional[ScheduleSource]) -> Optional[int]:
    """The checkpoint's run length when the length alone explains every difference, else None."""
    if source is None or "wd_incr_steps" not in checkpoint or any(k not in LENGTH_KEYS for k in differ):
        return None
    old = checkpoint["wd_incr_steps"] / source.samples_per_unit  # Megatron: run length x global batch
    if old != int(old) or int(old) == source.length or old <= 0:
        return None
    expected = source.steps_for_length(int(old))
    if all(_same(expected[key], checkpoint[key]) for key in LENGTH_KEYS):
        return int(old)
    return None


def _changes(differ: list[str], mine: dict[str, Any], other: dict[str, Any], source: Optional[ScheduleSource],
             other_name: str, conflict: bool = False) -> str:
    parts = []
    for key in differ:
        field = source.fields.get(key) if source is not None else None
        name = f"{_LABELS[key]} ({field})" if field else _LABELS[key]
        if conflict:
            parts.append(f"{name}: this config gives {_value(key, mine[key], source)}, the checkpoint "
                         f"{_value(key, other[key], source)}")
        else:
            parts.append(f"{name} {_value(key, mine[key], source)} ({other_name}: {_value(key, other[key], source)})")
    return "; ".join(parts) if conflict else ", ".join(parts)


def _describe_lengths(values: dict[str, Any], source: ScheduleSource) -> str:
    return (f"warmup {_value('lr_warmup_steps', values['lr_warmup_steps'], source)}, decay over "
            f"{_value('lr_decay_steps', values['lr_decay_steps'], source)}")


def _value(key: str, value: Any, source: Optional[ScheduleSource]) -> str:
    """A value as the user gives it: lengths in the config's unit, the rest as they are."""
    if key not in LENGTH_KEYS:
        return f"{value}"
    if source is None:
        return f"{value:g} samples"
    units = value / source.samples_per_unit
    return f"{units:g} {source.unit if units != 1 else source.unit[:-1]}"


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)
    return a == b


def _first_key(state_dict: dict[str, Any], *keys: str) -> Any:
    """Value of the first of ``keys`` present (older Megatron checkpoints used other names)."""
    for key in keys:
        if key in state_dict:
            return state_dict[key]
    raise CheckpointError(f"scheduler state in the checkpoint has none of the keys {list(keys)}")
