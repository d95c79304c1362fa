"""The training log: ``training_log`` / ``log_iteration``, called on every rank after every iteration.

Megatron's habits: the last rank prints one line every ``logger.log_interval`` iterations with losses
averaged over the interval; TensorBoard gets Megatron's tags every ``logger.tensorboard_log_interval``
iterations; W&B / MLflow / Comet get the same scalars. longspan adds one JSON object per iteration to
``metrics.jsonl`` (see ``GlobalState.metrics_logger``) for scripts and tests.

Loss values in ``loss_dict`` may be a Python float, a 0-d (or 1-element) tensor, or a 2-element
``[sum, count]`` tensor (the iteration's value is then ``sum / count``).

The line's text is ``log_format.py``; the MoE metrics ``moe_log.py``; the end-of-run throughput summary
``throughput_summary.py``; the validation block ``validation_log.py``.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch.distributed as dist

from longspan.config.schema.container import ConfigContainer
from longspan.core.logging import get_logger, get_rank, get_world_size, print_rank_last
from longspan.training.observability.loggers import log_scalars
from longspan.training.state import GlobalState
from longspan.training.utils.comm import reduce_max_stat_across_model_parallel_group
from longspan.training.observability.energy import interval_energy
from longspan.planner.flops import num_floating_point_operations
from longspan.training.observability.log_format import format_training_log_line
from longspan.training.observability.log_metrics import (
    ADVANCED_ITERS_KEY,
    NAN_ITERS_KEY,
    SKIPPED_ITERS_KEY,
    IterationMetrics,
    accumulate,
    interval_means,
    loss_value,
    reset,
    to_float,
)
from longspan.training.observability.log_sinks import logger_sinks, option, write_vs_samples
from longspan.training.observability.memory import dump_memory_snapshot, reduce_max_memory_across_pp_group, report_memory
from longspan.planner.peak_flops import mfu, peak_flops_per_device, reported_mfu
from longspan.training.observability.moe_log import track_moe_metrics
from longspan.training.observability.mtp_log import track_mtp_metrics
from longspan.training.utils.norms import report_l2_norm_grad
from longspan.training.observability.reports import report_runtime, report_throughput
from longspan.training.observability.run_summary import record_logged_window
from longspan.training.observability.throughput_summary import record_log_interval

logger = get_logger(__name__)

# Timers reported per logger.timing_log_level (Megatron's names; timers nobody started are left out).
TIMERS_LEVEL_1 = [
    "forward-backward",
    "layernorm-grads-all-reduce",
    "embedding-grads-all-reduce",
    "all-grads-sync",
    "params-all-gather",
    "optimizer-copy-to-main-grad",
    "optimizer-unscale-and-check-inf",
    "optimizer-clip-main-grad",
    "optimizer-count-zeros",
    "optimizer-inner-step",
    "optimizer-copy-main-to-model-params",
    "optimizer",
]
TIMERS_LEVEL_2 = [
    "batch-generator",
    "forward-compute",
    "backward-compute",
    "forward-recv",
    "forward-send",
    "backward-recv",
    "backward-send",
    "forward-send-forward-recv",
    "forward-send-backward-recv",
    "backward-send-forward-recv",
    "backward-send-backward-recv",
    "forward-backward-send-forward-backward-recv",
]


def current_global_batch_size(config: ConfigContainer, global_state: GlobalState) -> int:
    """The global batch size of this iteration: from the ramp-up calculator when set, else the config."""
    calculator = global_state.num_microbatches_calculator
    if calculator is not None and hasattr(calculator, "get_current_global_batch_size"):
        return int(calculator.get_current_global_batch_size())
    gbs = config.train.global_batch_size
    if gbs:
        return int(gbs)
    dp = config.data_parallel_size or 1
    return int(config.train.micro_batch_size) * int(dp)


def _seq_length(config: ConfigContainer, seq_length: Optional[int]) -> Optional[int]:
    if seq_length:
        return int(seq_length)
    for section in (config.model, config.dataset):
        if section is not None and section.seq_length:
            return int(section.seq_length)
    return None


def _flops_per_iteration(config: ConfigContainer, batch_size: int) -> Optional[float]:
    """Model FLOPs of one iteration, or None when the model config lacks the fields the formula needs."""
    try:
        return num_floating_point_operations(config, batch_size)
    except (AttributeError, TypeError, ValueError):
        return None


def training_log(
    loss_dict: dict[str, Any],
    total_loss_dict: dict[str, Any],
    learning_rate: Optional[float],
    decoupled_learning_rate: Optional[float],
    loss_scale: float,
    report_memory_flag: bool,
    skipped_iter: int,
    grad_norm: Optional[float],
    params_norm: Optional[float],
    num_zeros_in_grad: Optional[int],
    config: ConfigContainer,
    global_state: GlobalState,
    history_wct: list,
    model: list,
    pg_collection: Optional[Any] = None,
    log_max_attention_logit: Optional[float] = None,
    loaded_iteration: int = 0,
    seq_length: Optional[int] = None,
) -> bool:
    """Megatron Bridge's positional ``training_log``: ``log_iteration`` with an IterationMetrics."""
    metrics = IterationMetrics(
        loss_dict=loss_dict, learning_rate=learning_rate, loss_scale=loss_scale, skipped_iter=skipped_iter,
        grad_norm=grad_norm, params_norm=params_norm, num_zeros_in_grad=num_zeros_in_grad,
        decoupled_learning_rate=decoupled_learning_rate, max_attention_logit=log_max_attention_logit,
        seq_length=seq_length,
    )
    return log_iteration(metrics, total_loss_dict, report_memory_flag, config, global_state, history_wct, model,
                         pg_collection=pg_collection, loaded_iteration=loaded_iteration)


def log_iteration(
    metrics: IterationMetrics,
    total_loss_dict: dict[str, Any],
    report_memory_flag: bool,
    config: ConfigContainer,
    global_state: GlobalState,
    history_wct: list,
    model: list,
    *,
    pg_collection: Optional[Any] = None,
    loaded_iteration: int = 0,
) -> bool:
    """Log the iteration just finished (``global_state.train_state.step``); returns the new report_memory_flag.

    Call on every rank after every iteration (timers and memory reductions are collective). In order:
    accumulate the iteration into ``total_loss_dict`` (keep passing the same dict; start with {}); the
    collective reports (timers, memory, gradient norms); the sinks (TensorBoard / W&B / MLflow / Comet scalars
    every ``logger.tensorboard_log_interval``, one ``metrics.jsonl`` object per iteration); and every
    ``logger.log_interval`` Megatron's line on the last rank, the timers, and the memory report (while
    ``report_memory_flag``, until the second iteration after ``loaded_iteration``).
    """
    iteration = global_state.train_state.step
    values = {key: loss_value(v) for key, v in metrics.loss_dict.items()}
    # MoE: aux losses and load imbalance join the iteration's values (log line, sinks, metrics.jsonl).
    values.update(track_moe_metrics(model, config, global_state, iteration))
    # MTP: the per-depth losses ("mtp_1 loss", ...), megatron-core's names.
    values.update(track_mtp_metrics(model, config, global_state))
    values.update(metrics.extra_values)
    got_nan = accumulate(total_loss_dict, values, metrics.skipped_iter)
    ctx = _LogContext.create(metrics, config, global_state, history_wct, pg_collection, total_loss_dict)
    reports = _collective_reports(ctx, model)
    if ctx.any_sink and ctx.at_tb_step:
        _write_scalars(ctx, values, reports)
    _write_metrics_record(ctx, values, got_nan)
    if iteration % ctx.log_interval == 0:
        report_memory_flag = _log_interval(ctx, total_loss_dict, report_memory_flag, loaded_iteration)
    return report_memory_flag


class _LogContext:
    """What the parts of ``training_log`` share for one iteration (resolved once)."""

    @classmethod
    def create(cls, metrics: IterationMetrics, config: ConfigContainer, global_state: GlobalState, history_wct: list,
               pg_collection: Optional[Any], total_loss_dict: dict[str, Any]) -> "_LogContext":
        ctx = cls()
        ctx.metrics, ctx.config, ctx.global_state, ctx.history_wct = metrics, config, global_state, history_wct
        ctx.pg_collection = pg_collection
        ctx.logger_cfg = config.logger
        ctx.train_state = global_state.train_state
        ctx.iteration = ctx.train_state.step
        ctx.timers_to_log = TIMERS_LEVEL_1 * (ctx.logger_cfg.timing_log_level >= 1)
        ctx.timers_to_log = ctx.timers_to_log + TIMERS_LEVEL_2 * (ctx.logger_cfg.timing_log_level >= 2)
        ctx.batch_size = current_global_batch_size(config, global_state)
        ctx.total_iterations = total_loss_dict[ADVANCED_ITERS_KEY] + total_loss_dict[SKIPPED_ITERS_KEY]
        ctx.learning_rate = reduce_max_stat_across_model_parallel_group(
            metrics.learning_rate, option(pg_collection, "mp"))
        ctx.seq_len = _seq_length(config, metrics.seq_length)
        ctx.log_interval = max(1, int(ctx.logger_cfg.log_interval))
        ctx.at_tb_step = ctx.iteration % max(1, int(ctx.logger_cfg.tensorboard_log_interval)) == 0
        ctx.sinks = logger_sinks(global_state)
        ctx.any_sink = any(v is not None for v in ctx.sinks.values())
        ctx.flops = _flops_per_iteration(config, ctx.batch_size)
        ctx.flops_so_far = float(ctx.train_state.floating_point_operations_so_far or 0.0)
        if global_state._flops_at_last_log is None:
            # First call of this run: the running total already includes this iteration (and, after a resume,
            # everything done before), so the baseline is the total before this iteration.
            global_state._flops_at_last_log = max(0.0, ctx.flops_so_far - (ctx.flops or 0.0))
        log_throughput = bool(ctx.logger_cfg.log_throughput)
        ctx.peak = peak_flops_per_device(getattr(global_state, "device", None)) if log_throughput else None
        # logger.log_energy: the interval's energy (collective), in the line, the sinks and metrics.jsonl
        at_log = ctx.iteration % ctx.log_interval == 0
        ctx.energy = interval_energy(global_state.energy_monitor, ctx.total_iterations,
                                     get_world_size()) if at_log else None
        return ctx


def _collective_reports(ctx: _LogContext, model: list) -> dict[str, dict[str, Any]]:
    """The parts every rank must join: timers to TensorBoard, memory snapshot/statistics, gradient norms."""
    logger_cfg, iteration = ctx.logger_cfg, ctx.iteration
    if logger_cfg.log_timers_to_tensorboard and ctx.at_tb_step:
        # No reset: the text log at the next log interval resets, so both report the same interval.
        timer_metrics = ctx.global_state.timers.write(
            ctx.timers_to_log, None, iteration, normalizer=ctx.total_iterations, reset=False)
        log_scalars(timer_metrics, iteration, **ctx.sinks)
    profiling = ctx.config.profiling
    if profiling is not None and profiling.record_memory_history:
        if iteration == profiling.profile_step_end:
            dump_memory_snapshot(profiling)
    memory: dict[str, Any] = {}
    if logger_cfg.log_memory_to_tensorboard and ctx.at_tb_step:
        memory = reduce_max_memory_across_pp_group(
            report_memory(logger_cfg.memory_keys), option(ctx.pg_collection, "pp"))
    grad_norms: dict[str, float] = {}
    if logger_cfg.log_l2_norm_grad_to_tensorboard and ctx.at_tb_step:
        grad_norms = report_l2_norm_grad(model)  # DTensor gradients reduce over their mesh
    return {"memory": memory, "grad_norms": grad_norms}


def _write_scalars(ctx: _LogContext, values: dict[str, Any], reports: dict[str, dict[str, Any]]) -> None:
    """Megatron's TensorBoard tags (and the same scalars to W&B / MLflow / Comet)."""
    m, logger_cfg, train_state = ctx.metrics, ctx.logger_cfg, ctx.train_state
    scalars: dict[str, Any] = {}
    if ctx.learning_rate is not None:
        scalars["learning-rate"] = ctx.learning_rate
    if ctx.config.optimizer.decoupled_lr is not None and m.decoupled_learning_rate is not None:
        scalars["decoupled-learning-rate"] = m.decoupled_learning_rate
    if train_state.skipped_train_samples > 0:
        scalars["skipped-train-samples"] = train_state.skipped_train_samples
    scalars["batch-size"] = ctx.batch_size
    for key, value in values.items():
        scalars[key] = to_float(value)
    if logger_cfg.log_loss_scale_to_tensorboard:
        scalars["loss-scale"] = m.loss_scale
    if logger_cfg.log_world_size_to_tensorboard:
        scalars["world-size"] = get_world_size()
    for tag, value in (("grad-norm", m.grad_norm), ("num-zeros", m.num_zeros_in_grad),
                       ("params-norm", m.params_norm), ("max-attention-logit", m.max_attention_logit)):
        if value is not None:
            scalars[tag] = value
    log_scalars(scalars, ctx.iteration, **ctx.sinks)
    write_vs_samples(ctx.sinks["tb_writer"], scalars, train_state.consumed_train_samples)

    extra: dict[str, Any] = dict(reports["memory"])
    if logger_cfg.log_throughput_to_tensorboard and ctx.seq_len:
        window = int(logger_cfg.throughput_window_size)
        extra.update(real_token_rates(report_throughput(ctx.config.train, ctx.iteration, ctx.seq_len,
                                                        ctx.history_wct, window),
                                      ctx.global_state.real_token_marks, ctx.history_wct, window))
    if logger_cfg.log_runtime_to_tensorboard and ctx.seq_len:
        extra.update(report_runtime(train_state, ctx.global_state.start_time, ctx.seq_len,
                                    ctx.config.train.train_iters, logger_cfg.runtime_time_unit))
    extra.update(reports["grad_norms"])
    log_scalars(extra, ctx.iteration, **ctx.sinks)


def real_token_rates(rates: dict[str, Any], token_marks: list[int], history_wct: list, window: int) -> dict[str, Any]:
    """``report_throughput``'s rates with its token rates counting the window's real tokens (padding left out:
    ``token_marks`` holds the run's real-token total at each of ``history_wct``'s marks) instead of Megatron
    Bridge's ``samples × seq_length``."""
    if "throughput/tokens_per_sec" not in rates or len(token_marks) < window:
        return rates
    tokens = token_marks[-1] - token_marks[-window]
    elapsed = history_wct[-1] - history_wct[-window]
    return {**rates, "throughput/tokens_per_sec": tokens / elapsed,
            "throughput/device/tokens_per_sec": tokens / elapsed / get_world_size()}


def _write_metrics_record(ctx: _LogContext, values: dict[str, Any], got_nan: bool) -> None:
    """One JSON object per iteration in metrics.jsonl."""
    metrics_logger = ctx.global_state.metrics_logger
    if metrics_logger is None:
        return
    m, history_wct, seq_len = ctx.metrics, ctx.history_wct, ctx.seq_len
    flops = ctx.global_state.last_step_flops or ctx.flops  # the step's real tokens' FLOPs when counted
    iteration_time = history_wct[-1] - history_wct[-2] if len(history_wct) >= 2 else None
    loss_tokens = getattr(ctx.global_state, "last_loss_tokens", None)
    step_tokens = ctx.global_state.last_step_tokens or (ctx.batch_size * seq_len if seq_len else None)
    metrics_logger.write({
        "phase": "train",
        "iteration": ctx.iteration,
        "consumed_samples": ctx.train_state.consumed_train_samples,
        "timestamp": time.time(),
        "lr": ctx.learning_rate,
        "batch_size": ctx.batch_size,
        "losses": {key: to_float(value) for key, value in values.items()},
        "grad_norm": m.grad_norm,
        "params_norm": m.params_norm,
        "num_zeros": m.num_zeros_in_grad,
        "loss_scale": m.loss_scale,
        "iteration_time_s": iteration_time,
        # real tokens (padding left out; the config's shapes when the step's batches were not counted)
        "tokens": step_tokens,
        "tokens_per_s": step_tokens / iteration_time if iteration_time and step_tokens else None,
        # loss tokens: Σloss_mask of the global batch (no padding, no prompt tokens of SFT data)
        "loss_tokens": loss_tokens,
        "loss_tokens_per_s": loss_tokens / iteration_time if iteration_time and loss_tokens is not None else None,
        "throughput": flops / iteration_time / get_world_size() / 1e12 if iteration_time and flops else None,
        # None rather than a utilisation above 100% (the peak is too low; see longspan.planner.peak_flops)
        "mfu": reported_mfu(mfu(flops / iteration_time / get_world_size(), ctx.peak)) if iteration_time and flops
        else None,
        "skipped_iterations": int(m.skipped_iter),
        "nan_iterations": int(got_nan),
        **(ctx.energy or {}),
    })


def _interval_throughput(ctx: _LogContext, elapsed_time: float) -> Optional[float]:
    """TFLOP/s per GPU over the interval (None without a FLOPs formula for the model)."""
    if ctx.flops is None:
        return None
    if elapsed_time <= 0:
        return 0.0
    # FLOPs of this interval = growth of the trainer's running total since the last log; if the trainer does
    # not keep that total, the formula times the interval's iterations.
    global_state = ctx.global_state
    interval_flops = ctx.flops_so_far - global_state._flops_at_last_log
    if interval_flops <= 0:
        interval_flops = ctx.flops * ctx.total_iterations
    global_state._flops_at_last_log = ctx.flops_so_far
    # the interval's real tokens (padding left out, longspan.training.real_tokens); a caller that does not count
    # them (the loop counts every step it runs) gets the config's shapes
    tokens = global_state.real_tokens_so_far - global_state._tokens_at_last_log
    if tokens <= 0:
        tokens = ctx.batch_size * ctx.seq_len * ctx.total_iterations if ctx.seq_len else 0
    global_state._tokens_at_last_log = global_state.real_tokens_so_far
    record_log_interval(global_state, ctx.iteration, ctx.total_iterations, elapsed_time, tokens, interval_flops)
    return interval_flops / elapsed_time / get_world_size() / 1e12


def _log_interval(ctx: _LogContext, total_loss_dict: dict[str, Any], report_memory_flag: bool,
                  loaded_iteration: int) -> bool:
    """Every log_interval: the interval's scalars, Megatron's line, the memory report and the timers."""
    m, logger_cfg, iteration = ctx.metrics, ctx.logger_cfg, ctx.iteration
    timers, history_wct = ctx.global_state.timers, ctx.history_wct
    elapsed_time = timers("interval-time", log_level=0).elapsed(barrier=True)
    if elapsed_time <= 0 and len(history_wct) > ctx.total_iterations:
        # The trainer did not run the interval timer: measure the interval from the wall-clock history.
        elapsed_time = history_wct[-1] - history_wct[-1 - ctx.total_iterations]
    elapsed_per_iter = elapsed_time / max(1, ctx.total_iterations)
    per_gpu_tflops = _interval_throughput(ctx, elapsed_time)
    show_throughput = bool(logger_cfg.log_throughput)

    interval_scalars: dict[str, Any] = {}
    if logger_cfg.log_timers_to_tensorboard:
        interval_scalars["iteration-time"] = elapsed_per_iter
    if per_gpu_tflops is not None and show_throughput:
        interval_scalars["throughput"] = per_gpu_tflops
    if ctx.energy is not None:  # Megatron's tags
        interval_scalars["iter-energy/gpu"] = ctx.energy["energy_per_gpu_j_per_iter"]
        interval_scalars["power/gpu"] = ctx.energy["power_per_gpu_w"]
    if ctx.any_sink:
        log_scalars(interval_scalars, iteration, **ctx.sinks)

    means = interval_means(total_loss_dict)
    # the end-of-run summary's final loss is this line's (the forward step's losses, not the MoE/MTP extras)
    record_logged_window(ctx.global_state, iteration, ctx.total_iterations,
                         {key: means[key] for key in m.loss_dict if key in means})
    line = format_training_log_line(
        iteration=iteration,
        train_iters=ctx.config.train.train_iters,
        consumed_samples=ctx.train_state.consumed_train_samples,
        skipped_samples=ctx.train_state.skipped_train_samples,
        elapsed_ms=elapsed_per_iter * 1000.0,
        throughput=per_gpu_tflops if show_throughput else None,
        mfu=mfu(per_gpu_tflops * 1e12, ctx.peak) if per_gpu_tflops is not None else None,
        learning_rate=ctx.learning_rate,
        decoupled_learning_rate=m.decoupled_learning_rate,
        batch_size=ctx.batch_size,
        losses=means,
        loss_scale=m.loss_scale,
        grad_norm=m.grad_norm,
        num_zeros_in_grad=m.num_zeros_in_grad,
        params_norm=m.params_norm,
        max_attention_logit=m.max_attention_logit,
        skipped_iterations=total_loss_dict[SKIPPED_ITERS_KEY],
        nan_iterations=total_loss_dict[NAN_ITERS_KEY],
        energy=ctx.energy,
    )
    reset(total_loss_dict)
    print_rank_last(line)
    if report_memory_flag:
        report_memory_flag = _report_memory_once(ctx, loaded_iteration)
    timers.log(ctx.timers_to_log, normalizer=ctx.log_interval)
    return report_memory_flag


def _report_memory_once(ctx: _LogContext, loaded_iteration: int) -> bool:
    report = report_memory(ctx.logger_cfg.memory_keys)
    dp_group = option(ctx.pg_collection, "dp")
    dp_rank = dist.get_rank(group=dp_group) if dp_group is not None and dist.is_initialized() else get_rank()
    if report and dp_rank == 0:
        text = f"(after {ctx.iteration} iterations) memory (GB)"
        for name, value in report.items():
            text += f" | {name}: {value}"
        logger.info(f"[Rank {get_rank()}] {text}")
    # The report after the second iteration includes the optimizer state.
    return not ctx.iteration > loaded_iteration + 1


