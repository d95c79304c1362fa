"""Batch and schedule rules: the global batch and its ramp-up, the number of microbatches, the training length
(iterations from samples) and the scheduler's step counts (``ConfigContainer.validate()``), and the arguments of
the LR scheduler (``SCHEDULER_ARGUMENT_RULES``, run by ``OptimizerParamScheduler`` when it is built).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

from longspan.config.explicit import explicit_fields, is_recipe_source
from longspan.core.errors import ConfigError
from longspan.core.logging import get_logger, warn_rank_0
from longspan.config.rules.ranges import positive_int

if TYPE_CHECKING:
    from longspan.config.schema.container import ConfigContainer

_log = get_logger(__name__)

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")
WD_INCR_STYLES = ("constant", "linear", "cosine")


def check_batch(cfg: "ConfigContainer", dp: int) -> int:
    """The global batch (derived when None) against micro batch x ``dp``; return the number of microbatches."""
    t = cfg.train
    if t.micro_batch_size is None:
        raise ConfigError("train.micro_batch_size is required (samples per forward pass on one rank)")
    mbs = positive_int(t.micro_batch_size, "train.micro_batch_size")
    if t.global_batch_size is None:
        t.global_batch_size = mbs * dp
    gbs = positive_int(t.global_batch_size, "train.global_batch_size")
    per_step = mbs * dp
    if gbs % per_step != 0:
        if not t.decrease_batch_size_if_needed:
            raise ConfigError(
                f"train.global_batch_size={gbs} is not divisible by train.micro_batch_size ({mbs}) x "
                f"data-parallel size ({dp}) = {per_step}"
            )
        if gbs < per_step:
            raise ConfigError(
                f"train.global_batch_size={gbs} is smaller than train.micro_batch_size ({mbs}) x "
                f"data-parallel size ({dp}) = {per_step}, even with decrease_batch_size_if_needed"
            )
        warn_rank_0(
            f"train.global_batch_size={gbs} is not divisible by {per_step}: using "
            f"{gbs // per_step * per_step} (decrease_batch_size_if_needed)",
            _log,
        )
    ramp = t.rampup_batch_size
    if ramp is not None:
        if len(ramp) != 3 or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in ramp):
            raise ConfigError(
                f"train.rampup_batch_size={ramp!r} must be three positive integers [start, increment, samples]"
            )
        start, incr, _ = ramp
        if start > gbs or (gbs - start) % incr != 0:
            raise ConfigError(
                f"train.rampup_batch_size={ramp!r}: train.global_batch_size ({gbs}) minus the start ({start}) "
                f"must be a non-negative multiple of the increment ({incr})"
            )
    return gbs // per_step


def check_train_length(cfg: "ConfigContainer") -> None:
    """Exactly one of train_iters / train_samples; with train_samples the iteration count is derived.

    As Megatron's ``update_train_iters``, sample-based training sets ``train.train_iters`` from the samples
    (walking the batch-size ramp-up), so a second ``validate()`` derives the same value again.
    """
    t = cfg.train
    if t.train_iters is None and t.train_samples is None:
        raise ConfigError("give one of train.train_iters and train.train_samples (both are null)")
    for name in ("train_iters", "train_samples"):
        value = getattr(t, name)
        if value is not None and value < 0:
            raise ConfigError(f"train.{name}={value} must not be negative")
    if t.train_samples is None and t.rampup_batch_size is not None:
        raise ConfigError(
            "train.rampup_batch_size needs sample-based training: set train.train_samples instead of train.train_iters"
        )
    if t.train_samples is not None:
        t.train_iters = _iterations_for_samples(t.train_samples, t.global_batch_size, t.rampup_batch_size)


def _iterations_for_samples(train_samples: int, global_batch_size: int, rampup: Optional[list]) -> int:
    """Iterations that consume ``train_samples``, walking the batch-size ramp-up as Megatron does."""
    if rampup is None:
        return train_samples // global_batch_size
    start, increment, ramp_samples = rampup
    num_increments = (global_batch_size - start) // increment
    per_increment = ramp_samples / num_increments if num_increments else 0.0
    iterations = consumed = 0
    while consumed <= ramp_samples and consumed <= train_samples:
        steps = int(consumed / per_increment) if per_increment else 0
        consumed += min(global_batch_size, start + steps * increment)
        iterations += 1
    return iterations + max(0, train_samples - consumed) // global_batch_size


def compute_scheduler_steps(cfg: "ConfigContainer") -> None:
    """Warmup/decay/weight-decay lengths in samples, as Megatron computes them (reference §3)."""
    s, t, opt = cfg.scheduler, cfg.train, cfg.optimizer
    if opt.lr is None:
        raise ConfigError("optimizer.lr is required (the peak learning rate)")
    if opt.min_lr < 0 or opt.min_lr > opt.lr:
        raise ConfigError(f"optimizer.min_lr={opt.min_lr} must be between 0 and optimizer.lr={opt.lr}")
    decoupled_lr, decoupled_min_lr = opt.decoupled_lr, opt.decoupled_min_lr
    if decoupled_min_lr is not None and decoupled_lr is None:
        raise ConfigError(f"optimizer.decoupled_min_lr={decoupled_min_lr} needs optimizer.decoupled_lr (the peak "
                          "learning rate of the embedding and output layer): set it, or leave decoupled_min_lr None")
    if decoupled_lr is not None and decoupled_min_lr is not None and decoupled_min_lr > decoupled_lr:
        raise ConfigError(f"optimizer.decoupled_min_lr={decoupled_min_lr} must be between 0 and "
                          f"optimizer.decoupled_lr={decoupled_lr}")
    if s.lr_warmup_init < 0 or s.lr_warmup_init > opt.lr:
        raise ConfigError(f"scheduler.lr_warmup_init={s.lr_warmup_init} must be between 0 and optimizer.lr={opt.lr}")
    if s.override_opt_param_scheduler and s.use_checkpoint_opt_param_scheduler:
        raise ConfigError(
            "scheduler.override_opt_param_scheduler and scheduler.use_checkpoint_opt_param_scheduler are both "
            "True: choose one"
        )
    gbs = t.global_batch_size
    if t.train_samples is not None:
        if s.lr_decay_iters is not None or s.lr_warmup_iters != 0 or s.lr_wsd_decay_iters is not None:
            raise ConfigError(
                "sample-based training (train.train_samples) uses scheduler.lr_decay_samples / lr_warmup_samples / "
                "lr_wsd_decay_samples, not the *_iters fields"
            )
        s.lr_decay_steps = s.lr_decay_samples if s.lr_decay_samples is not None else t.train_samples
        s.wd_incr_steps = t.train_samples
        s.wsd_decay_steps = s.lr_wsd_decay_samples
        warmup = _warmup_samples(s.lr_warmup_fraction, s.lr_decay_steps, "lr_warmup_samples", s.lr_warmup_samples, 1)
    else:
        if s.lr_decay_samples is not None or s.lr_warmup_samples != 0 or s.lr_wsd_decay_samples is not None:
            raise ConfigError(
                "iteration-based training (train.train_iters) uses scheduler.lr_decay_iters / lr_warmup_iters / "
                "lr_wsd_decay_iters, not the *_samples fields"
            )
        decay_iters = s.lr_decay_iters if s.lr_decay_iters is not None else t.train_iters
        _fit_recipe_warmup(cfg, decay_iters)
        s.lr_decay_steps = decay_iters * gbs
        s.wd_incr_steps = t.train_iters * gbs
        s.wsd_decay_steps = s.lr_wsd_decay_iters * gbs if s.lr_wsd_decay_iters is not None else None
        warmup = _warmup_samples(s.lr_warmup_fraction, s.lr_decay_steps, "lr_warmup_iters", s.lr_warmup_iters, gbs)
    if s.lr_warmup_fraction is not None and not 0.0 <= s.lr_warmup_fraction <= 1.0:
        raise ConfigError(f"scheduler.lr_warmup_fraction={s.lr_warmup_fraction} must be between 0 and 1")
    if s.lr_decay_steps <= 0 and not t.skip_train:
        raise ConfigError(
            f"the learning rate decays over {s.lr_decay_steps} samples: increase train.train_iters/train_samples "
            "or scheduler.lr_decay_iters/lr_decay_samples"
        )
    by_samples = t.train_samples is not None
    check_warmup_shorter_than_decay(warmup, s.lr_decay_steps, 1 if by_samples else gbs,
                                    "samples" if by_samples else "iterations")
    s.lr_warmup_steps = warmup
    if s.lr_decay_style == "WSD" and s.wsd_decay_steps is None:
        raise ConfigError(
            "scheduler.lr_decay_style='WSD' needs scheduler.lr_wsd_decay_iters (or lr_wsd_decay_samples)"
        )
    if s.start_weight_decay is None:
        s.start_weight_decay = opt.weight_decay
    if s.end_weight_decay is None:
        s.end_weight_decay = opt.weight_decay
    if s.start_weight_decay < 0 or s.end_weight_decay < s.start_weight_decay:
        raise ConfigError(
            f"scheduler.start_weight_decay={s.start_weight_decay} must be >= 0 and <= "
            f"scheduler.end_weight_decay={s.end_weight_decay}"
        )


def _warmup_samples(fraction: Optional[float], decay_samples: int, count_field: str, count: int,
                    samples_per_count: int) -> float:
    """The warmup in samples, from ``scheduler.lr_warmup_fraction`` of the decay or from the warmup count of the
    training's unit (``count_field``: lr_warmup_iters, ``samples_per_count`` samples each, or lr_warmup_samples)."""
    if fraction is not None and count != 0:
        raise ConfigError(f"set only one of scheduler.lr_warmup_fraction and scheduler.{count_field}")
    return fraction * decay_samples if fraction is not None else count * samples_per_count


def check_warmup_shorter_than_decay(warmup: float, decay: float, samples_per_unit: int = 1,
                                    unit: str = "samples") -> None:
    """Warmup ends before the decay does (both in samples), as Megatron Core asserts: a longer warmup would never
    reach the peak learning rate. A decay of 0 or less is its callers' to reject (validate() lets
    ``train.skip_train`` runs have one). Checked by validate() (the message in the run's unit: iterations of
    ``samples_per_unit`` samples, or samples) and by the LR scheduler on its arguments."""
    if decay > 0 and not warmup < decay:
        raise ConfigError(
            f"scheduler warmup ({warmup / samples_per_unit:g} {unit}) is not shorter than the decay "
            f"({decay / samples_per_unit:g} {unit}): shorten scheduler.lr_warmup_iters/lr_warmup_samples/"
            "lr_warmup_fraction or lengthen scheduler.lr_decay_iters/train.train_iters"
        )


def _fit_recipe_warmup(cfg: "ConfigContainer", decay_iters: int) -> None:
    """A recipe's warmup in iterations (the finetuning recipes' 50, Megatron Bridge's) that a shorter run cannot
    hold becomes 5% of the decay, as 50 is of the recipes' 1000 iterations, and one line says so: a recipe is a
    template, and ``train.train_iters=20`` should not fail on a value the user never chose. A warmup the user
    gave (a dotlist key, a YAML file's field) is checked as given."""
    s = cfg.scheduler
    if s.lr_warmup_fraction is not None or not decay_iters or s.lr_warmup_iters < decay_iters:
        return
    source = explicit_fields(cfg, "scheduler").get("lr_warmup_iters")
    if source is None or not is_recipe_source(source):
        return
    fitted = decay_iters // 20
    warn_rank_0(
        f"scheduler.lr_warmup_iters: the {source}'s warmup of {s.lr_warmup_iters} iterations does not fit a decay "
        f"of {decay_iters} (train.train_iters or scheduler.lr_decay_iters): warming up for {fitted} (5%); set "
        "scheduler.lr_warmup_iters to choose", _log)
    s.lr_warmup_iters = fitted


# ---------------------------------------------------------------------------------------------------------
# the LR scheduler's arguments: ``s`` is anything with OptimizerParamScheduler's attribute names
# ---------------------------------------------------------------------------------------------------------
def check_lr_range(s: Any) -> None:
    """0 <= min_lr <= max_lr, and warmup starts at or below the peak."""
    if not s.min_lr >= 0.0:
        raise ConfigError(f"optimizer.min_lr={s.min_lr} is invalid: it must be >= 0")
    if not s.max_lr >= s.min_lr:
        raise ConfigError(f"optimizer.lr={s.max_lr} is invalid: it must be >= optimizer.min_lr ({s.min_lr})")
    if not s.init_lr <= s.max_lr:
        raise ConfigError(
            f"scheduler.lr_warmup_init={s.init_lr} is invalid: it must be <= optimizer.lr ({s.max_lr})"
        )


def check_lr_lengths(s: Any) -> None:
    """A positive decay length and a warmup shorter than it."""
    if not s.lr_decay_steps > 0:
        raise ConfigError(
            f"scheduler.lr_decay_steps={s.lr_decay_steps} is invalid: it must be > 0 "
            "(set train.train_iters or scheduler.lr_decay_iters)"
        )
    check_warmup_shorter_than_decay(s.lr_warmup_steps, s.lr_decay_steps)


def check_lr_decay_style(s: Any) -> None:
    """A known decay style; WSD needs its annealing length and shape."""
    if s.lr_decay_style not in LR_DECAY_STYLES:
        raise ConfigError(
            f"scheduler.lr_decay_style={s.lr_decay_style!r} is invalid: valid styles are {list(LR_DECAY_STYLES)}"
        )
    if s.lr_decay_style == "WSD":
        if s.wsd_decay_steps is None:
            raise ConfigError(
                "scheduler.lr_wsd_decay_iters=None is invalid with lr_decay_style='WSD': set the length "
                "of the annealing phase"
            )
        if s.lr_wsd_decay_style not in WSD_DECAY_STYLES:
            raise ConfigError(
                f"scheduler.lr_wsd_decay_style={s.lr_wsd_decay_style!r} is invalid: valid styles are "
                f"{list(WSD_DECAY_STYLES)}"
            )


def check_weight_decay_schedule(s: Any) -> None:
    """0 <= start_wd <= end_wd, a known increment style, and 'constant' only with start == end."""
    if not s.start_wd >= 0.0:
        raise ConfigError(f"scheduler.start_weight_decay={s.start_wd} is invalid: it must be >= 0")
    if not s.end_wd >= s.start_wd:
        raise ConfigError(
            f"scheduler.end_weight_decay={s.end_wd} is invalid: it must be >= start_weight_decay ({s.start_wd})"
        )
    if s.wd_incr_style not in WD_INCR_STYLES:
        raise ConfigError(
            f"scheduler.weight_decay_incr_style={s.wd_incr_style!r} is invalid: valid styles are "
            f"{list(WD_INCR_STYLES)}"
        )
    if s.wd_incr_style == "constant" and s.start_wd != s.end_wd:
        raise ConfigError(
            f"scheduler.weight_decay_incr_style='constant' needs start_weight_decay ({s.start_wd}) == "
            f"end_weight_decay ({s.end_wd}); use 'linear' or 'cosine' to change weight decay"
        )


def check_checkpoint_choice(s: Any) -> None:
    """At most one of 'the config's values win' and 'the checkpoint's values win'."""
    if s.override_opt_param_scheduler and s.use_checkpoint_opt_param_scheduler:
        raise ConfigError(
            "scheduler.override_opt_param_scheduler=True and use_checkpoint_opt_param_scheduler=True "
            "contradict each other: set at most one"
        )


# What OptimizerParamScheduler checks when it is built, in order.
SCHEDULER_ARGUMENT_RULES: list[tuple[str, Callable[[Any], None]]] = [
    ("learning-rate range", check_lr_range),
    ("warmup and decay lengths", check_lr_lengths),
    ("decay style", check_lr_decay_style),
    ("weight-decay schedule", check_weight_decay_schedule),
    ("checkpoint or config values on resume", check_checkpoint_choice),
]
