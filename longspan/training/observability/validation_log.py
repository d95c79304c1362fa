"""Megatron's validation block (``log_validation_results``): the printed line, the scalars, metrics.jsonl."""

from __future__ import annotations

import math
from typing import Any

from longspan.core.logging import print_rank_last
from longspan.training.observability.loggers import log_scalars
from longspan.training.state import GlobalState
from longspan.training.observability.log_metrics import loss_value, to_float
from longspan.training.observability.log_sinks import logger_sinks, write_vs_samples


def log_validation_results(
    prefix: str,
    loss_dict: dict[str, Any],
    iteration: int,
    global_state: GlobalState,
    write_to_tensorboard: bool = True,
) -> str:
    """Print Megatron's validation block and write ``'<key> validation'`` (and ``... ppl``) scalars.

    Args:
        prefix: what was evaluated, e.g. ``"iteration 100"``, ``"iteration 100 on validation set"`` or
            ``"iteration 100 on test set"``; the line reads `` validation loss at {prefix} | ...``.
        loss_dict: averaged losses ({name: float | 0-d tensor | [sum, count] tensor}).
        iteration: the step the scalars are written at.
        global_state: the GlobalState (config, sinks, consumed samples).
        write_to_tensorboard: False skips TensorBoard (Megatron does so for the test set after skip_train).

    Returns:
        The line (also printed between two dashed lines on the last rank). Perplexity is ``exp(min(20, loss))``.
    """
    cfg = global_state.cfg
    log_ppl = bool(cfg.logger.log_validation_ppl_to_tensorboard)
    consumed = global_state.train_state.consumed_train_samples
    sinks = logger_sinks(global_state)
    if not write_to_tensorboard:
        sinks["tb_writer"] = None
    losses = {key: to_float(loss_value(v)) for key, v in loss_dict.items()}
    line = f" validation loss at {prefix} | "
    scalars: dict[str, float] = {}
    ppls: dict[str, float] = {}
    for key, value in losses.items():
        ppl = math.exp(min(20.0, value))
        ppls[key] = ppl
        line += f"{key} value: {value:.6E} | {key} PPL: {ppl:.6E} | "
        scalars[f"{key} validation"] = value
        if log_ppl:
            scalars[f"{key} validation ppl"] = ppl
    log_scalars(scalars, iteration, **sinks)
    write_vs_samples(sinks["tb_writer"], scalars, consumed)
    metrics_logger = global_state.metrics_logger
    if metrics_logger is not None:
        metrics_logger.write(
            {"phase": "validation", "prefix": prefix, "iteration": iteration, "losses": losses, "ppl": ppls}
        )
    dashes = "-" * (len(line) + 1)
    print_rank_last(dashes)
    print_rank_last(line)
    print_rank_last(dashes)
    return line
