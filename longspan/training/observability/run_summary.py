"""The run's last line: what this run trained, how fast and its final loss, or that there was nothing to train.

"final lm loss" is the "lm loss" of the last training log line. Megatron's line comes at the iterations
divisible by ``logger.log_interval`` and shows each loss averaged over the iterations since the line before (the
logging window). When a run ends between two lines (7 iterations with log_interval=3: lines at 3 and 6), the
final loss is still the last line's, the mean over iterations 4-6; the summary names the window
("mean of iterations 4-6, the last log line"), so its number is always one the log showed. A run that printed
no line (fewer iterations than log_interval, or ``logger.skip_train_metrics_log``) says why instead of a number.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

from longspan.core.logging import get_logger, print_rank_0, print_rank_last
from longspan.training.observability.throughput_summary import run_throughput_summary
from longspan.training.state import GlobalState

logger = get_logger(__name__)


@dataclass(frozen=True)
class LoggedWindow:
    """The iterations a training log line averaged over and the losses it printed."""

    first_iteration: int
    last_iteration: int
    losses: dict[str, float]

    def describe(self) -> str:
        if self.first_iteration == self.last_iteration:
            return f"iteration {self.last_iteration}, the last log line"
        return f"mean of iterations {self.first_iteration}-{self.last_iteration}, the last log line"


def record_logged_window(global_state: GlobalState, iteration: int, num_iterations: int,
                         losses: dict[str, float]) -> None:
    """Remember what the training log line of ``iteration`` printed (its window: the last ``num_iterations``)."""
    global_state._last_logged_window = LoggedWindow(iteration - num_iterations + 1, iteration, dict(losses))


def last_logged_window(global_state: GlobalState) -> Optional[LoggedWindow]:
    return getattr(global_state, "_last_logged_window", None)


def nothing_to_train(state: GlobalState) -> bool:
    """The loaded checkpoint is already at (or past) ``train.train_iters``: a run would train no iteration."""
    train = state.cfg.train
    iters = train.train_iters or 0
    return not train.skip_train and iters > 0 and state.start_iteration >= iters


def nothing_to_train_line(state: GlobalState) -> str:
    start, iters = state.start_iteration, state.cfg.train.train_iters
    relation = "= train.train_iters" if start == iters else f"> train.train_iters={iters}"
    return (f"longspan: nothing to train: the checkpoint is at iteration {start} {relation}; "
            "raise train.train_iters to continue")


def final_loss_text(state: GlobalState) -> str:
    """'final lm loss 4.123457E+00 (mean of iterations 4-6, the last log line)', or why there is no number."""
    window = last_logged_window(state)
    if window is not None and window.losses:
        values = ", ".join(f"{key} {value:.6E}" for key, value in window.losses.items())
        return f"final {values} ({window.describe()})"
    logger_cfg = state.cfg.logger
    if logger_cfg.skip_train_metrics_log:
        return "final loss n/a (logger.skip_train_metrics_log=True: no training log line)"
    trained = state.train_state.step - state.start_iteration
    return (f"final loss n/a (no training log line: logger.log_interval={logger_cfg.log_interval}, "
            f"{trained} iteration{'' if trained == 1 else 's'} trained)")


def summary_line(state: GlobalState, elapsed: float) -> str:
    """'longspan: done: ...': this run's iterations, time, tokens/s, final loss, steady throughput, outputs."""
    cfg = state.cfg
    where = []
    if cfg.checkpoint.save:
        where.append(f"checkpoints in {cfg.checkpoint.save}")
    if cfg.logger.tensorboard_dir:
        where.append(f"TensorBoard logs in {cfg.logger.tensorboard_dir}")
    places = "".join(f"; {w}" for w in where)
    step, start = state.train_state.step, state.start_iteration
    if cfg.train.skip_train:
        return f"longspan: done: evaluation only (train.skip_train=True) at iteration {step} in {elapsed:.1f} s{places}"
    trained = step - start
    if start and trained > 1:
        span = f"iterations {start + 1}-{step}"
    elif start and trained == 1:
        span = f"iteration {step}"
    else:
        span = f"{trained} iteration{'' if trained == 1 else 's'}"
    if step < (cfg.train.train_iters or 0):
        span += f" (stopped before train.train_iters={cfg.train.train_iters})"
    tokens = state.real_tokens_so_far  # real tokens, padding left out (longspan.training.real_tokens)
    padding = ""
    if state.positions_so_far > tokens:
        share = 100.0 * (state.positions_so_far - tokens) / state.positions_so_far
        padding = f" ({tokens} real tokens; padding {share:.1f}% of the batches' positions)"
    steady = run_throughput_summary(state)
    return (f"longspan: done: {span} in {elapsed:.1f} s, {tokens / max(elapsed, 1e-9):.0f} tokens/s overall"
            f"{padding}, {final_loss_text(state)}" + (f"; {steady}" if steady else "") + places)


def print_run_summary(state: GlobalState) -> None:
    """The end-of-run line, on the last rank (the one that holds the losses under pipeline parallelism)."""
    print_rank_last(summary_line(state, time.time() - state.start_time), logger)


def print_nothing_to_train(state: GlobalState) -> None:
    """Once, on rank 0 (the rank a launcher's console and a user read first); every rank knows it alike."""
    print_rank_0(nothing_to_train_line(state), logger)


__all__ = [
    "LoggedWindow", "final_loss_text", "last_logged_window", "nothing_to_train", "nothing_to_train_line",
    "print_nothing_to_train", "print_run_summary", "record_logged_window", "summary_line",
]
