"""Evaluation on the validation and test iterators (Megatron's ``evaluate`` / ``evaluate_and_print_results``)."""

from __future__ import annotations

import time
from typing import Any, Callable, Iterator, Optional

import torch

from longspan.core.logging import get_logger, print_rank_last
from longspan.training.callbacks import fire_event
from longspan.training.resilience.inprocess import report_progress
from longspan.training.step.schedules import reduce_loss_reports, run_forward_backward
from longspan.training.state import GlobalState
from longspan.training.observability.eval_samples import log_eval_samples
from longspan.training.observability.validation_log import log_validation_results

logger = get_logger(__name__)


def evaluate(
    state: GlobalState,
    forward_step_func: Callable,
    data_iterator: Optional[Iterator],
    model: list[torch.nn.Module],
    process_non_loss_data_func: Optional[Callable],
    config: Any,
    verbose: bool = False,
    non_loss_data_func: Optional[Callable] = None,
    is_test: bool = False,
) -> tuple[dict[str, torch.Tensor], Any, bool]:
    """``eval_iters`` forward-only global batches; returns ({name: Σ/Σ loss}, non-loss data, timelimit_hit).

    ``is_test``: fire the callbacks' ``on_test_*`` events instead of ``on_eval_*``."""
    cfg = state.cfg
    parallel = state.parallel
    phase = "test" if is_test else "eval"
    for chunk in model:
        chunk.eval()
    fire_event(state, f"on_{phase}_start", model)
    eval_batch_size = state.num_microbatches_calculator.get_current_global_batch_size()
    num_microbatches = eval_batch_size // (cfg.train.micro_batch_size * parallel.dp_size)
    reports: list[dict[str, Any]] = []
    timelimit_hit = False
    with torch.no_grad():
        for step in range(cfg.train.eval_iters):
            if verbose:
                print_rank_last(f"Evaluating iter {step + 1}/{cfg.train.eval_iters}", logger)
            fire_event(state, f"on_{phase}_step_start", model)
            step_reports, _ = run_forward_backward(
                state, forward_step_func, data_iterator, model, num_microbatches, forward_only=True
            )
            fire_event(state, f"on_{phase}_step_end", model)
            reports.extend(step_reports)
            report_progress()  # in-process restart's soft_timeout: an evaluation step is progress
            state.train_state.consumed_valid_samples += eval_batch_size
            limit = cfg.train.exit_duration_in_mins
            if limit and (time.time() - state.start_time) / 60.0 > limit:
                timelimit_hit = True
                break
    # Σ/Σ over every microbatch of every evaluation step and data-parallel rank, as for training.
    results = reduce_loss_reports(reports, parallel.dp_group if parallel.dp_size > 1 else None)
    collected = None
    if process_non_loss_data_func is not None and non_loss_data_func is not None:
        collected = non_loss_data_func(model)
    fire_event(state, f"on_{phase}_end", model, total_loss_dict=results)
    return results, collected, timelimit_hit


def evaluate_and_print_results(
    state: GlobalState,
    prefix: str,
    forward_step_func: Callable,
    data_iterator: Optional[Iterator],
    model: list[torch.nn.Module],
    config: Any,
    verbose: bool = False,
    write_to_tensorboard: bool = True,
    process_non_loss_data_func: Optional[Callable] = None,
    non_loss_data_func: Optional[Callable] = None,
    sample_generations: bool = True,
    is_test: bool = False,
) -> dict[str, float]:
    """Evaluate, print Megatron's validation block and write ``<loss> validation`` (and ppl) to the sinks.

    With ``logger.log_eval_samples`` (and ``sample_generations``, False for the test set) greedy continuations of
    validation prompts are logged too. ``is_test``: the test set (the callbacks' ``on_test_*`` events)."""
    results, collected, _ = evaluate(
        state, forward_step_func, data_iterator, model, process_non_loss_data_func, config, verbose, non_loss_data_func,
        is_test=is_test,
    )
    log_validation_results(prefix, results, state.train_state.step, state, write_to_tensorboard=write_to_tensorboard)
    if collected is not None and process_non_loss_data_func is not None:
        process_non_loss_data_func(collected, state.train_state.step, state.tensorboard_logger)
    if sample_generations:
        log_eval_samples(state, model, state.train_state.step)
    return {key: float(v) for key, v in results.items()}
