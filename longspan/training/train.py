"""The training loop (Bridge's training.train): data → forward/backward over microbatches → reduce → optimizer and
scheduler step → log → evaluate → checkpoint-and-exit, read top to bottom.

Side concerns (timers, metric sinks, profiler, signal handler) are small objects the loop calls.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

from longspan.core.logging import get_logger, get_rank, print_rank_0
from longspan.parallel.compile import mark_cuda_graph_step
from longspan.parallel.replica_hash import check_param_hashes_across_dp_replicas, replicated_parameter_count
from longspan.training.callbacks import fire_event, stop_requested
from longspan.training.checkpointing.save import finalize_async_saves, save_checkpoint
from longspan.training.eval import evaluate_and_print_results
from longspan.parallel.expert_parallel import update_expert_biases
from longspan.training.step.schedules import (
    TrainingDivergedError,
    finalize_model_grads,
    reduce_loss_reports,
    run_forward_backward,
)
from longspan.training.optim.optimizer import NonFiniteGradError
from longspan.training.step.grad_checks import reduced_grad_checks
from longspan.training.checkpointing.non_persistent import save_non_persistent, should_save_non_persistent
from longspan.training.resilience.hooks import (
    after_forward_backward,
    after_iteration,
    before_iteration,
    checkpoint_phase_finished,
    checkpoint_phase_started,
    ensure_rerun_state_machine,
    resilience_stop_requested,
    training_loop_finished,
    training_loop_started,
)
from longspan.training.observability.profiling import (
    handle_profiling_step,
    handle_profiling_stop,
    initialize_pytorch_profiler,
    profiler_trace_dir,
    should_profile_rank,
)
from longspan.training.state import GlobalState
from longspan.planner.flops import floating_point_operations_of_tokens, num_floating_point_operations
from longspan.training.real_tokens import count_real_tokens, global_token_counts
from longspan.training.observability.log_line import log_iteration
from longspan.training.observability.log_metrics import IterationMetrics
from longspan.training.observability.progress_log import (  # noqa: F401 - Bridge's names in train
    compute_throughputs_and_append_to_progress_log,
    get_start_time_from_progress_log,
)
from longspan.training.utils.train_utils import (
    calc_params_l2_norm,
    prepare_forward_step_func,
    training_log,
)

logger = get_logger(__name__)


@dataclass
class _LoopState:
    """What the loop carries from one iteration to the next besides ``GlobalState``."""

    prof: Optional[torch.profiler.profile]
    should_toggle_forward_pre_hook: bool
    nsys_nvtx_context: Any = None
    total_loss_dict: dict[str, Any] = field(default_factory=dict)
    history_wct: list[float] = field(default_factory=list)
    report_memory_flag: bool = True
    flops_since_last_log: float = 0.0


def _begin_training(
    forward_step_func: Callable, model: list[torch.nn.Module], global_state: GlobalState,
    train_data_iterator: Optional[Iterator],
) -> tuple[Callable, _LoopState, Optional[Iterator]]:
    """The model chunks in training mode, the prepared forward step, the loop's state (profiler, pre-hook
    toggling), the data iterator behind the rerun state machine; Python's GC off with ``train.manual_gc``."""
    cfg = global_state.cfg
    for chunk in model:
        chunk.train()
    forward_step_func = prepare_forward_step_func(forward_step_func, global_state)
    loop = _LoopState(
        prof=_start_pytorch_profiler(cfg),
        should_toggle_forward_pre_hook=should_disable_forward_pre_hook(
            False, cfg.optimizer.use_distributed_optimizer, cfg.ddp.overlap_param_gather
        ),
    )
    global_state.last_saved_step = None
    # counted before the rerun machine's replay, so a re-run iteration is not counted twice
    train_data_iterator, global_state.real_token_counter = count_real_tokens(train_data_iterator)
    train_data_iterator = ensure_rerun_state_machine(global_state).wrap_data_iterator(train_data_iterator)
    if cfg.train.manual_gc:
        gc.disable()
        gc.collect()
    training_loop_started(global_state)  # resilience: in-process restart's progress watch
    return forward_step_func, loop, train_data_iterator


def train(
    forward_step_func: Callable,
    model: list[torch.nn.Module],
    optimizer: Any,
    scheduler: Any,
    train_data_iterator: Optional[Iterator],
    valid_data_iterator: Optional[Iterator],
    global_state: GlobalState,
    checkpointing_context: dict[str, Any],
    process_non_loss_data_func: Optional[Callable] = None,
    non_loss_data_func: Optional[Callable] = None,
) -> None:
    """Train until ``train.train_iters``, an exit condition, or a signal; evaluate and checkpoint on the way."""
    cfg = global_state.cfg
    train_state = global_state.train_state
    forward_step_func, loop, train_data_iterator = _begin_training(
        forward_step_func, model, global_state, train_data_iterator)
    fire_event(global_state, "on_train_start", model, optimizer=optimizer, scheduler=scheduler)

    def save() -> None:
        save_checkpoint_and_time(
            global_state, model, optimizer, scheduler, train_state.floating_point_operations_so_far,
            checkpointing_context, train_data_iterator=train_data_iterator,
        )

    global_state.timers("interval-time", log_level=0).start(barrier=True)
    skip = set(cfg.train.iterations_to_skip or ())
    while train_state.step < cfg.train.train_iters:
        loop.nsys_nvtx_context = (
            handle_profiling_step(cfg.profiling, train_state.step, get_rank(), loop.prof) or loop.nsys_nvtx_context
        )
        global_state.num_microbatches_calculator.update(train_state.consumed_train_samples, True)
        if train_state.step in skip:
            _skip_iteration(global_state, train_data_iterator)
            continue

        fire_event(global_state, "on_train_step_start", model, optimizer=optimizer, scheduler=scheduler)
        before_iteration(global_state)  # resilience: the straggler detector's step timer
        loss_dict, skipped_iter, should_checkpoint, should_exit, exit_code, grad_norm, num_zeros_in_grad = (
            train_step(forward_step_func, train_data_iterator, model, optimizer, scheduler, global_state)
        )
        if should_checkpoint:
            save()
        if should_exit:
            global_state.exit_code = exit_code
            break
        fire_event(global_state, "on_train_step_end", model, optimizer=optimizer, scheduler=scheduler,
                   loss_dict=loss_dict, grad_norm=grad_norm, skipped_iter=bool(skipped_iter))

        _count_iteration(global_state, loop, skipped_iter)
        if not cfg.logger.skip_train_metrics_log:
            _log_train_iteration(global_state, loop, model, optimizer, loss_dict, skipped_iter, grad_norm,
                                 num_zeros_in_grad)
        global_state.last_loss_dict = loss_dict
        _evaluate_at_interval(global_state, forward_step_func, valid_data_iterator, model,
                              process_non_loss_data_func, non_loss_data_func)

        post_training_step_callbacks(
            model, loop.flops_since_last_log, getattr(global_state, "straggler_timer", None), train_state.step,
            loop.prof, cfg, loop.should_toggle_forward_pre_hook, loop.nsys_nvtx_context,
        )
        finalize_async_saves(checkpointing_context, blocking=False)
        if checkpoint_and_decide_exit(
            global_state, model, optimizer, scheduler, train_state.floating_point_operations_so_far,
            checkpointing_context, train_data_iterator,
        ):
            break
        if resilience_stop_requested(global_state):  # straggler stop_if_detected: the final save follows
            break

    if _final_save_due(global_state):
        save()
    finalize_async_saves(checkpointing_context, blocking=True)
    if cfg.train.manual_gc:
        gc.enable()
    _finish_train(global_state)
    fire_event(global_state, "on_train_end", model, optimizer=optimizer, scheduler=scheduler)


def _skip_iteration(global_state: GlobalState, train_data_iterator: Any) -> None:
    """``train.iterations_to_skip``: read and drop the iteration's global batch, train on nothing.

    As Megatron-LM's loop: the step and the consumed and skipped samples advance by one global batch (so a
    resumed run's samplers stay in step); no forward, backward, optimizer or LR-scheduler step, no log line.
    """
    train_state = global_state.train_state
    num_microbatches = global_state.num_microbatches_calculator.get()
    iterators = train_data_iterator if isinstance(train_data_iterator, list) else [train_data_iterator]
    for iterator in iterators:
        if iterator is None:
            continue
        for _ in range(num_microbatches):
            next(iterator)
        if hasattr(iterator, "advance"):  # a replayable iterator must not re-run the dropped batch
            iterator.advance()
    if global_state.real_token_counter is not None:  # the dropped batches are not this run's tokens
        global_state.real_token_counter.take()
    batch_size = global_state.num_microbatches_calculator.get_current_global_batch_size()
    print_rank_0(f"skipping iteration {train_state.step + 1} (train.iterations_to_skip lists {train_state.step}, "
                 f"the count of completed iterations): its {batch_size} samples are read but not trained on", logger)
    train_state.step += 1
    train_state.consumed_train_samples += batch_size
    train_state.skipped_train_samples += batch_size


def _count_iteration(global_state: GlobalState, loop: _LoopState, skipped_iter: int) -> None:
    """Advance the step, the consumed (and skipped) samples, the FLOPs and the wall-clock history."""
    train_state = global_state.train_state
    train_state.step += 1
    after_iteration(global_state)  # resilience: heartbeat
    batch_size = global_state.num_microbatches_calculator.get_current_global_batch_size()
    train_state.consumed_train_samples += batch_size
    if skipped_iter:
        train_state.skipped_train_samples += batch_size
    counts = global_state.last_token_counts  # (real tokens, Σ length², positions) of the global batch
    if counts is None:  # batches that carry no tokens (T5): as many as the config's shapes say
        positions = batch_size * int(global_state.cfg.model.seq_length or 0)
        counts = (positions, positions * int(global_state.cfg.model.seq_length or 0), positions)
        flops = num_floating_point_operations(global_state.cfg, batch_size)
    else:
        flops = floating_point_operations_of_tokens(global_state.cfg, counts[0], counts[1])
    global_state.last_token_counts = None  # counted once
    global_state.last_step_tokens, global_state.last_step_flops = counts[0], flops
    global_state.real_tokens_so_far += counts[0]
    global_state.positions_so_far += counts[2]
    train_state.floating_point_operations_so_far += flops
    loop.flops_since_last_log += flops
    loop.history_wct.append(time.time() - global_state.start_time)
    global_state.real_token_marks.append(global_state.real_tokens_so_far)
    # Only the throughput window and one log interval are ever read back: keep no more marks than those.
    logger_cfg = global_state.cfg.logger
    keep = max(int(logger_cfg.throughput_window_size), int(logger_cfg.log_interval) + 1, 2)
    del loop.history_wct[:-keep]
    del global_state.real_token_marks[:-keep]


def _log_train_iteration(
    global_state: GlobalState,
    loop: _LoopState,
    model: list[torch.nn.Module],
    optimizer: Any,
    loss_dict: dict[str, torch.Tensor],
    skipped_iter: int,
    grad_norm: Optional[float],
    num_zeros_in_grad: Optional[int],
) -> None:
    """The iteration's metrics to the log line and the metric sinks."""
    cfg = global_state.cfg
    params_norm = calc_params_l2_norm(model, cfg.model) if cfg.logger.log_params_norm else None
    metrics = IterationMetrics(
        loss_dict=loss_dict,
        learning_rate=_current_learning_rate(optimizer),
        decoupled_learning_rate=_decoupled_learning_rate(optimizer),
        loss_scale=float(optimizer.get_loss_scale()),
        skipped_iter=skipped_iter,
        grad_norm=grad_norm,
        params_norm=params_norm,
        num_zeros_in_grad=num_zeros_in_grad,
    )
    loop.report_memory_flag = log_iteration(
        metrics, loop.total_loss_dict, loop.report_memory_flag, cfg, global_state, loop.history_wct, model
    )


def _evaluate_at_interval(
    global_state: GlobalState,
    forward_step_func: Callable,
    valid_data_iterator: Optional[Iterator],
    model: list[torch.nn.Module],
    process_non_loss_data_func: Optional[Callable],
    non_loss_data_func: Optional[Callable],
) -> None:
    """Evaluate on the validation data every ``train.eval_interval`` iterations, then back to training mode."""
    cfg = global_state.cfg
    train_cfg = cfg.train
    step = global_state.train_state.step
    if not (train_cfg.eval_interval and step % train_cfg.eval_interval == 0
            and global_state.train_state.do_valid and valid_data_iterator is not None):
        return
    if train_cfg.manual_gc and train_cfg.manual_gc_eval:
        gc.collect()
    evaluate_and_print_results(
        global_state, f"iteration {step}", forward_step_func, valid_data_iterator, model,
        cfg, verbose=False, write_to_tensorboard=True,
        process_non_loss_data_func=process_non_loss_data_func, non_loss_data_func=non_loss_data_func,
    )
    if train_cfg.manual_gc and train_cfg.manual_gc_eval:
        gc.collect()
    for chunk in model:
        chunk.train()


def _final_save_due(global_state: GlobalState) -> bool:
    """The final state is always saved (Megatron saves at the end unless the last iteration just did)."""
    step = global_state.train_state.step
    return bool(
        global_state.cfg.checkpoint.save
        and step > 0
        and global_state.last_saved_step != step
        and getattr(global_state, "exit_code", None) is None
    )


def train_step(
    forward_step_func: Callable,
    data_iterator: Optional[Iterator],
    model: list[torch.nn.Module],
    optimizer: Any,
    scheduler: Any,
    global_state: GlobalState,
) -> tuple[dict[str, torch.Tensor], int, bool, bool, int, Optional[float], Optional[int]]:
    """One iteration: forward/backward over the microbatches, gradient reduction, optimizer and LR step.

    Returns (loss_dict, skipped_iter, should_checkpoint, should_exit, exit_code, grad_norm,
    num_zeros_in_grad). ``loss_dict`` holds each reported loss as Σ(loss·mask)/Σmask over every microbatch
    and data-parallel rank.
    """
    cfg = global_state.cfg
    timers = global_state.timers
    parallel = global_state.parallel
    num_microbatches = global_state.num_microbatches_calculator.get()
    iteration = global_state.train_state.step + 1

    rerun = ensure_rerun_state_machine(global_state)
    while rerun.should_run_forward_backward():  # more than once when the rerun state machine re-runs it
        optimizer.zero_grad()
        if getattr(global_state, "cuda_graphs", False):
            mark_cuda_graph_step()
        timers("forward-backward", log_level=1).start(barrier=cfg.model.barrier_with_L1_time)
        reports, num_tokens = run_forward_backward(
            global_state, forward_step_func, data_iterator, model, num_microbatches,
            forward_only=False,
            grad_scale_func=optimizer.scale_loss if _uses_loss_scaling(optimizer) else None,
            check_for_nan=global_state.check_for_nan and rerun.mode != "validate_results",
            iteration=iteration,
        )
        timers("forward-backward").stop()
        rerun.validate_reports(reports)
    should_checkpoint, should_exit, exit_code = after_forward_backward(global_state, iteration)
    if should_exit:
        return {}, 0, should_checkpoint, True, exit_code, None, None
    global_state.last_loss_tokens = _global_loss_tokens(num_tokens, parallel, global_state.device)
    global_state.last_token_counts = global_token_counts(
        global_state.real_token_counter, parallel, global_state.device)
    if cfg.model.calculate_per_token_loss:
        finalize_model_grads(model, num_tokens, dp_group=parallel.dp_group, dp_size=parallel.dp_size)
    update_expert_biases(model, parallel)  # aux-loss-free routing: once per step, before the optimizer (Megatron)

    if cfg.train.empty_unused_memory_level >= 1 and global_state.device.type == "cuda":
        torch.cuda.empty_cache()

    reduced_grad_checks(global_state).check(model, iteration, get_rank(), loss_scaling=_uses_loss_scaling(optimizer))
    timers("optimizer", log_level=1).start(barrier=cfg.model.barrier_with_L1_time)
    optimizer.check_for_nan_in_grad = global_state.check_for_nan
    try:
        update_successful, grad_norm, num_zeros_in_grad = optimizer.step()
    except NonFiniteGradError as exc:  # with fp16 loss scaling an overflow skips the step instead
        raise TrainingDivergedError(
            f"the gradient norm is {exc.grad_norm} at iteration {iteration}; stopped before the update "
            "(lower optimizer.lr, enable gradient clipping, or use bf16_mixed instead of fp16)"
        ) from None
    timers("optimizer").stop()

    if update_successful:
        increment = num_microbatches * cfg.train.micro_batch_size * parallel.dp_size
        scheduler.step(increment=increment)
        skipped_iter = 0
    else:
        skipped_iter = 1

    if cfg.train.empty_unused_memory_level >= 2 and global_state.device.type == "cuda":
        torch.cuda.empty_cache()

    loss_dict = reduce_loss_reports(reports, parallel.dp_group if parallel.dp_size > 1 else None)
    return loss_dict, skipped_iter, False, False, 0, grad_norm, num_zeros_in_grad


def _global_loss_tokens(num_tokens: torch.Tensor, parallel: Any, device: torch.device) -> int:
    """Σloss_mask over the global batch (padding excluded): the tokens the loss is an average over."""
    total = torch.as_tensor(num_tokens).detach().to(device=device, dtype=torch.int64).reshape(())
    if parallel.dp_size > 1:
        total = total.clone()
        dist.all_reduce(total, group=parallel.dp_group)
    return int(total)


def post_training_step_callbacks(
    model: list[torch.nn.Module],
    num_floating_point_operations_since_last_log_event: float,
    straggler_timer: Any,
    iteration: int,
    prof: Optional[torch.profiler.profile],
    config: Any,
    should_toggle_forward_pre_hook: bool,
    nsys_nvtx_context: Any = None,
) -> None:
    """Run what follows every step: the end of profiling, weight-hash checks, manual garbage collection."""
    handle_profiling_stop(config.profiling, iteration, get_rank(), prof, nsys_nvtx_context)
    interval = config.train.check_weight_hash_across_dp_replicas_interval
    if interval and iteration % interval == 0:
        if should_toggle_forward_pre_hook:
            disable_forward_pre_hook(model)
        if iteration == interval and replicated_parameter_count(model) == 0:
            print_rank_0(
                "train.check_weight_hash_across_dp_replicas_interval: no parameter has a data-parallel replica "
                "here (fully sharded or one data-parallel rank), so the check compares nothing", logger)
        if not check_param_hashes_across_dp_replicas(model):
            raise RuntimeError(f"parameter hashes differ across data-parallel replicas at iteration {iteration}")
        if should_toggle_forward_pre_hook:
            enable_forward_pre_hook(model)
    if config.train.manual_gc and config.train.manual_gc_interval and iteration % config.train.manual_gc_interval == 0:
        gc.collect()
    sync_interval = config.train.train_sync_interval
    if sync_interval and iteration % sync_interval == 0 and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def should_disable_forward_pre_hook(
    use_megatron_fsdp: bool, use_distributed_optimizer: bool, overlap_param_gather: bool
) -> bool:
    """Forward pre-hooks must be off while checkpointing only with Megatron's overlapped param gather."""
    return not use_megatron_fsdp and use_distributed_optimizer and overlap_param_gather


def enable_forward_pre_hook(model: list[torch.nn.Module]) -> None:
    """Re-enable parameter-gather pre-hooks. A no-op for torch DDP/FSDP2, which own their hooks."""
    for chunk in model:
        hook = getattr(chunk, "enable_forward_pre_hook", None)
        if callable(hook):
            hook()


def disable_forward_pre_hook(model: list[torch.nn.Module], param_sync: bool = True) -> None:
    """Disable parameter-gather pre-hooks. A no-op for torch DDP/FSDP2, which own their hooks."""
    for chunk in model:
        hook = getattr(chunk, "disable_forward_pre_hook", None)
        if callable(hook):
            hook(param_sync=param_sync)


def save_checkpoint_and_time(
    state: GlobalState,
    model: list[torch.nn.Module],
    optimizer: Any,
    opt_param_scheduler: Any,
    num_floating_point_operations_so_far: float,
    checkpointing_context: dict[str, Any],
    non_persistent_ckpt: bool = False,
    train_data_iterator: Optional[Iterator] = None,
) -> None:
    """Save a checkpoint, time it, and append the progress-log line."""
    timers = state.timers
    should_toggle = should_disable_forward_pre_hook(
        False, state.cfg.optimizer.use_distributed_optimizer, state.cfg.ddp.overlap_param_gather
    )
    if should_toggle:
        disable_forward_pre_hook(model)
    checkpoint_phase_started(state)  # resilience: the heartbeat monitor allows the checkpoint timeout
    timers("save-checkpoint", log_level=0).start(barrier=True)
    if non_persistent_ckpt:  # checkpoint.non_persistent_ckpt_type: global (DCP) or local (per-rank files)
        save_non_persistent(
            state, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far,
            checkpointing_context, train_data_iterator=train_data_iterator,
        )
    else:
        save_checkpoint(
            state, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far,
            checkpointing_context, train_data_iterator=train_data_iterator,
        )
    timers("save-checkpoint").stop(barrier=True)
    checkpoint_phase_finished(state)
    timers.log(["save-checkpoint"])
    if not non_persistent_ckpt:  # the final save stays persistent even when a non-persistent one just ran
        state.last_saved_step = state.train_state.step
    if state.cfg.logger.log_progress:
        compute_throughputs_and_append_to_progress_log(state, num_floating_point_operations_so_far)
    if should_toggle:
        enable_forward_pre_hook(model)


def checkpoint_and_decide_exit(
    state: GlobalState,
    model: list[torch.nn.Module],
    optimizer: Any,
    opt_param_scheduler: Any,
    num_floating_point_operations_so_far: float,
    checkpointing_context: dict[str, Any],
    train_data_iterator: Optional[Iterator],
) -> bool:
    """Megatron's order: signal → save and exit; interval saves; exit duration; exit interval (or a callback's
    stop request)."""
    cfg = state.cfg
    step = state.train_state.step
    save = cfg.checkpoint.save

    def do_save() -> None:
        save_checkpoint_and_time(
            state, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far,
            checkpointing_context, train_data_iterator=train_data_iterator,
        )

    if cfg.train.exit_signal_handler and state.signal_handler is not None:
        if any(state.signal_handler.signals_received()):
            if save:
                do_save()
            print_rank_0(f"exiting program after receiving signal {state.signal_handler.sig} at iteration {step}", logger)
            return True

    saved = False
    if save and cfg.checkpoint.save_interval and step % cfg.checkpoint.save_interval == 0:
        do_save()
        saved = True
    elif should_save_non_persistent(cfg.checkpoint, step):
        save_checkpoint_and_time(
            state, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far,
            checkpointing_context, non_persistent_ckpt=True, train_data_iterator=train_data_iterator,
        )

    if cfg.train.exit_duration_in_mins:
        minutes = torch.tensor([(time.time() - state.start_time) / 60.0], dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(minutes, op=dist.ReduceOp.MAX)
        if minutes.item() > cfg.train.exit_duration_in_mins:
            if save and not saved:
                do_save()
            print_rank_0(f"exiting program after {minutes.item():.1f} minutes at iteration {step}", logger)
            return True

    callback_stop = stop_requested(state)
    if callback_stop or (cfg.train.exit_interval and step % cfg.train.exit_interval == 0):
        if save and not saved:
            do_save()
        if dist.is_initialized():
            dist.barrier()
        print_rank_0(f"exiting program at iteration {step}" + (" (a callback asked to stop)" if callback_stop else ""),
                     logger)
        return True
    return False


def _finish_train(global_state: GlobalState) -> None:
    """Flush the metric sinks (the test evaluation still writes to them) and release the signal handler."""
    training_loop_finished(global_state)
    global_state.flush_loggers()
    if global_state.signal_handler is not None:
        global_state.signal_handler.release()


def _handle_mxfp8_param_buffer_copy(optimizer: Any, reuse_grad_buf_for_mxfp8_param_ag: bool, overlap_param_gather: bool) -> None:
    """MXFP8 parameter buffers do not exist in longspan (no Transformer Engine); nothing to copy."""
    if reuse_grad_buf_for_mxfp8_param_ag and overlap_param_gather:
        copy = getattr(optimizer, "_copy_main_params_to_param_buffer", None)
        if callable(copy):
            copy()


# ----------------------------------------------------------------------------------------------- helpers


def _current_learning_rate(optimizer: Any) -> Optional[float]:
    for group in optimizer.param_groups:
        if not group.get("is_decoupled_lr", False):
            return float(group["lr"])
    return None


def _decoupled_learning_rate(optimizer: Any) -> Optional[float]:
    """Learning rate of the embedding/output group (``optimizer.decoupled_lr``), None when there is none."""
    for group in optimizer.param_groups:
        if group.get("is_decoupled_lr", False):
            return float(group["lr"])
    return None


def _uses_loss_scaling(optimizer: Any) -> bool:
    return getattr(optimizer, "grad_scaler", None) is not None


def _start_pytorch_profiler(cfg: Any) -> Optional[torch.profiler.profile]:
    """A started, scheduled torch profiler on the ranks in ``profiling.profile_ranks`` (None elsewhere)."""
    profiling = cfg.profiling
    if profiling is None or not profiling.use_pytorch_profiler or not should_profile_rank(profiling, get_rank()):
        return None
    prof = initialize_pytorch_profiler(profiling, profiler_trace_dir(cfg))
    prof.start()
    return prof
