"""The training log (``training_log``) and the validation block (``log_validation_results``).

Megatron's habits: the last rank prints one line every ``logger.log_interval`` iterations with losses
averaged over the interval; TensorBoard gets Megatron's tags every ``logger.tensorboard_log_interval``
iterations; W&B / MLflow / Comet get the same scalars. longspan adds one JSON object per iteration to
``metrics.jsonl`` (see ``GlobalState.metrics_logger``) for scripts and tests.

Loss values in ``loss_dict`` may be a Python float, a 0-d (or 1-element) tensor, or a 2-element
``[sum, count]`` tensor (the iteration's value is then ``sum / count``).
"""

from __future__ import annotations

import math
import time
from datetime import datetime
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from longspan.core.logging import get_logger, get_rank, get_world_size, print_rank_last
from longspan.training.loggers import log_scalars
from longspan.training.state import GlobalState
from longspan.training.utils.comm import reduce_max_stat_across_model_parallel_group
from longspan.training.utils.flop_utils import num_floating_point_operations
from longspan.training.utils.mfu import mfu, peak_flops_per_device
from longspan.training.utils.memory import dump_memory_snapshot, reduce_max_memory_across_pp_group, report_memory
from longspan.training.utils.norms import report_l2_norm_grad
from longspan.training.utils.reports import report_runtime, report_throughput

logger = get_logger(__name__)

ADVANCED_ITERS_KEY = "advanced iterations"
SKIPPED_ITERS_KEY = "skipped iterations"
NAN_ITERS_KEY = "nan iterations"
_COUNTER_KEYS = (ADVANCED_ITERS_KEY, SKIPPED_ITERS_KEY, NAN_ITERS_KEY)

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


def _opt(section: Any, name: str, default: Any = None) -> Any:
    return default if section is None else getattr(section, name, default)


def loss_value(value: Any) -> Union[float, torch.Tensor]:
    """One iteration's value of a loss entry: float stays float; tensors become a 0-d float tensor.

    A 2-element tensor is ``[sum, count]`` and yields ``sum / count``. Tensors are not synchronized to the
    host here, so accumulating costs no device sync.
    """
    if isinstance(value, torch.Tensor):
        value = value.detach()
        if value.numel() == 2:
            flat = value.reshape(-1).float()
            return flat[0] / flat[1]
        if value.numel() != 1:
            raise ValueError(f"a loss value must have 1 or 2 elements ([sum, count]), got shape {tuple(value.shape)}")
        return value.reshape(()).float()
    return float(value)


def _to_float(value: Union[float, torch.Tensor]) -> float:
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)


def current_global_batch_size(config: Any, global_state: GlobalState) -> int:
    """The global batch size of this iteration: from the ramp-up calculator when set, else the config."""
    calculator = getattr(global_state, "num_microbatches_calculator", None)
    if calculator is not None and hasattr(calculator, "get_current_global_batch_size"):
        return int(calculator.get_current_global_batch_size())
    gbs = _opt(config.train, "global_batch_size")
    if gbs:
        return int(gbs)
    dp = getattr(config, "data_parallel_size", None) or 1
    return int(config.train.micro_batch_size) * int(dp)


def _seq_length(config: Any, seq_length: Optional[int]) -> Optional[int]:
    if seq_length:
        return int(seq_length)
    for section in ("model", "dataset"):
        value = _opt(getattr(config, section, None), "seq_length")
        if value:
            return int(value)
    return None


def _flops_per_iteration(config: Any, batch_size: int) -> Optional[float]:
    """Model FLOPs of one iteration, or None when the model config lacks the fields the formula needs."""
    try:
        return num_floating_point_operations(config, batch_size)
    except (AttributeError, TypeError, ValueError):
        return None


def _add_log_interval(global_state: GlobalState, iteration: int, num_iterations: int, seconds: float,
                      tokens: int, flops: float) -> None:
    """Record one log interval (interval timer seconds, tokens, model FLOPs) for ``run_throughput_summary``."""
    intervals = getattr(global_state, "_log_intervals", None)
    if intervals is None:
        intervals = global_state._log_intervals = []
    intervals.append((iteration - num_iterations + 1, iteration, float(seconds), int(tokens), float(flops)))


def run_throughput_summary(global_state: GlobalState) -> Optional[str]:
    """'iterations a-b: N tokens/s/device, x TFLOP/s/device, MFU y%' over this run's log intervals after the
    first (which holds start-up and compile warm-up), or the first when it is the only one; None without any."""
    intervals = getattr(global_state, "_log_intervals", None) or []
    steady = intervals[1:] or intervals
    seconds = sum(i[2] for i in steady)
    if seconds <= 0:
        return None
    world = get_world_size()
    tokens, flops = sum(i[3] for i in steady), sum(i[4] for i in steady)
    text = f"iterations {steady[0][0]}-{steady[-1][1]}: {tokens / seconds / world:.0f} tokens/s/device"
    if flops > 0:
        per_device = flops / seconds / world
        value = mfu(per_device, peak_flops_per_device(getattr(global_state, "device", None)))
        text += f", {per_device / 1e12:.3g} TFLOP/s/device"
        if value is not None:
            text += f", MFU {100.0 * value:.1f}%"
    return text


def _sinks(global_state: GlobalState) -> dict[str, Any]:
    return {
        "tb_writer": global_state.tensorboard_logger,
        "wandb_logger": global_state.wandb_logger,
        "mlflow_logger": global_state.mlflow_logger,
        "comet_logger": global_state.comet_logger,
    }


def _write_vs_samples(tb_writer: Any, metrics: dict[str, Any], consumed_samples: int) -> None:
    """Megatron also writes each scalar against consumed samples as ``'<tag> vs samples'``."""
    if tb_writer is None:
        return
    for tag, value in metrics.items():
        tb_writer.add_scalar(f"{tag} vs samples", value, consumed_samples)


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
    config: Any,
    global_state: GlobalState,
    history_wct: list,
    model: list,
    pg_collection: Optional[Any] = None,
    log_max_attention_logit: Optional[float] = None,
    loaded_iteration: int = 0,
    seq_length: Optional[int] = None,
) -> bool:
    """Log training stats (losses, learning rate, timings, etc.) for the iteration just finished.

    Call on every rank after every iteration (timers and memory reductions are collective). Accumulates the
    iteration's losses into ``total_loss_dict`` (skipped iterations are not averaged in; a skipped iteration
    whose loss is NaN/Inf counts as a nan iteration); writes TensorBoard / W&B / MLflow / Comet scalars every
    ``logger.tensorboard_log_interval``; appends the iteration's JSON object to ``metrics.jsonl``; and every
    ``logger.log_interval`` prints Megatron's line on the last rank, prints the timers, and resets the
    interval's accumulators.

    Args:
        loss_dict: this iteration's losses ({name: float | 0-d tensor | [sum, count] tensor}).
        total_loss_dict: accumulators across the logging interval (start with {}; keep passing the same dict).
        learning_rate: current learning rate (None on ranks without parameters).
        decoupled_learning_rate: current decoupled learning rate, if ``optimizer.decoupled_lr`` is used.
        loss_scale: current loss scale (1.0 without fp16).
        report_memory_flag: print the memory line at the next log interval (turned off once past the
            second iteration after ``loaded_iteration``).
        skipped_iter: 1 if the optimizer skipped this iteration (fp16 overflow), else 0.
        grad_norm: gradient norm, or None.
        params_norm: parameter norm (``logger.log_params_norm``), or None.
        num_zeros_in_grad: number of zeros in the gradient, or None.
        config: the ConfigContainer.
        global_state: the GlobalState (train_state.step is the iteration just finished).
        history_wct: wall-clock time at the end of each iteration (seconds, any origin).
        model: list of model chunks (for gradient norms per layer).
        pg_collection: process groups with ``mp``, ``pp`` and ``dp`` (None on one process).
        log_max_attention_logit: maximum attention logit, if tracked.
        loaded_iteration: iteration the run resumed from.
        seq_length: sequence length of this iteration's batch (default: ``model.seq_length``).

    Returns:
        The updated report_memory_flag.
    """
    logger_cfg = config.logger
    train_cfg = config.train
    timers = global_state.timers
    train_state = global_state.train_state
    iteration = train_state.step
    consumed = train_state.consumed_train_samples
    mp_group = _opt(pg_collection, "mp")
    pp_group = _opt(pg_collection, "pp")

    # ---- accumulate this iteration
    if not skipped_iter:
        total_loss_dict[ADVANCED_ITERS_KEY] = total_loss_dict.get(ADVANCED_ITERS_KEY, 0) + 1
    else:
        total_loss_dict.setdefault(ADVANCED_ITERS_KEY, 0)
    total_loss_dict[SKIPPED_ITERS_KEY] = total_loss_dict.get(SKIPPED_ITERS_KEY, 0) + int(skipped_iter)
    values = {key: loss_value(v) for key, v in loss_dict.items()}
    # MoE: aux losses and load imbalance join the iteration's values (log line, sinks, metrics.jsonl).
    values.update(track_moe_metrics(model, config, global_state, iteration))
    got_nan = False
    for key, value in values.items():
        if not skipped_iter:
            total_loss_dict[key] = total_loss_dict.get(key, 0.0) + value
        else:
            got_nan = got_nan or not math.isfinite(_to_float(value))
    total_loss_dict[NAN_ITERS_KEY] = total_loss_dict.get(NAN_ITERS_KEY, 0) + int(got_nan)

    timers_to_log: list[str] = []
    if logger_cfg.timing_log_level >= 1:
        timers_to_log += TIMERS_LEVEL_1
    if logger_cfg.timing_log_level >= 2:
        timers_to_log += TIMERS_LEVEL_2

    batch_size = current_global_batch_size(config, global_state)
    total_iterations = total_loss_dict[ADVANCED_ITERS_KEY] + total_loss_dict[SKIPPED_ITERS_KEY]
    learning_rate = reduce_max_stat_across_model_parallel_group(learning_rate, mp_group)
    seq_len = _seq_length(config, seq_length)
    tb_interval = max(1, int(_opt(logger_cfg, "tensorboard_log_interval", 1)))
    log_interval = max(1, int(_opt(logger_cfg, "log_interval", 100)))
    at_tb_step = iteration % tb_interval == 0
    sinks = _sinks(global_state)
    tb_writer = sinks["tb_writer"]
    any_sink = any(v is not None for v in sinks.values())

    # ---- collective parts: every rank joins
    if _opt(logger_cfg, "log_timers_to_tensorboard", False) and at_tb_step:
        # No reset: the text log at the next log interval resets, so both report the same interval.
        timer_metrics = timers.write(timers_to_log, None, iteration, normalizer=total_iterations, reset=False)
        log_scalars(timer_metrics, iteration, **sinks)
    profiling = getattr(config, "profiling", None)
    if profiling is not None and getattr(profiling, "record_memory_history", False):
        if iteration == getattr(profiling, "profile_step_end", -1):
            dump_memory_snapshot(profiling)
    memory_metrics: dict[str, Any] = {}
    if _opt(logger_cfg, "log_memory_to_tensorboard", False) and at_tb_step:
        memory_metrics = reduce_max_memory_across_pp_group(report_memory(_opt(logger_cfg, "memory_keys")), pp_group)
    grad_norm_metrics: dict[str, float] = {}
    if _opt(logger_cfg, "log_l2_norm_grad_to_tensorboard", False) and at_tb_step:
        grad_norm_metrics = report_l2_norm_grad(model)  # DTensor gradients reduce over their mesh

    # ---- scalars every tensorboard_log_interval
    if any_sink and at_tb_step:
        scalars: dict[str, Any] = {}
        if learning_rate is not None:
            scalars["learning-rate"] = learning_rate
        if _opt(_opt(config, "optimizer"), "decoupled_lr") is not None and decoupled_learning_rate is not None:
            scalars["decoupled-learning-rate"] = decoupled_learning_rate
        if train_state.skipped_train_samples > 0:
            scalars["skipped-train-samples"] = train_state.skipped_train_samples
        scalars["batch-size"] = batch_size
        for key, value in values.items():
            scalars[key] = _to_float(value)
        if _opt(logger_cfg, "log_loss_scale_to_tensorboard", True):
            scalars["loss-scale"] = loss_scale
        if _opt(logger_cfg, "log_world_size_to_tensorboard", False):
            scalars["world-size"] = get_world_size()
        if grad_norm is not None:
            scalars["grad-norm"] = grad_norm
        if num_zeros_in_grad is not None:
            scalars["num-zeros"] = num_zeros_in_grad
        if params_norm is not None:
            scalars["params-norm"] = params_norm
        if log_max_attention_logit is not None:
            scalars["max-attention-logit"] = log_max_attention_logit
        log_scalars(scalars, iteration, **sinks)
        _write_vs_samples(tb_writer, scalars, consumed)

        extra: dict[str, Any] = dict(memory_metrics)
        if _opt(logger_cfg, "log_throughput_to_tensorboard", False) and seq_len:
            extra.update(
                report_throughput(
                    train_cfg, iteration, seq_len, history_wct, int(_opt(logger_cfg, "throughput_window_size", 100))
                )
            )
        if _opt(logger_cfg, "log_runtime_to_tensorboard", False) and seq_len:
            extra.update(
                report_runtime(
                    train_state,
                    global_state.start_time,
                    seq_len,
                    train_cfg.train_iters,
                    _opt(logger_cfg, "runtime_time_unit", "hours"),
                )
            )
        extra.update(grad_norm_metrics)
        log_scalars(extra, iteration, **sinks)

    # ---- one JSON object per iteration
    metrics_logger = global_state.metrics_logger
    iteration_time = history_wct[-1] - history_wct[-2] if len(history_wct) >= 2 else None
    flops = _flops_per_iteration(config, batch_size)
    so_far = float(train_state.floating_point_operations_so_far or 0.0)
    if global_state._flops_at_last_log is None:
        # First call of this run: the running total already includes this iteration (and, after a resume,
        # everything done before), so the baseline is the total before this iteration.
        global_state._flops_at_last_log = max(0.0, so_far - (flops or 0.0))
    log_throughput = bool(_opt(logger_cfg, "log_throughput", False))
    peak = peak_flops_per_device(getattr(global_state, "device", None)) if log_throughput else None
    if metrics_logger is not None:
        loss_tokens = getattr(global_state, "last_loss_tokens", None)
        record = {
            "phase": "train",
            "iteration": iteration,
            "consumed_samples": consumed,
            "timestamp": time.time(),
            "lr": learning_rate,
            "batch_size": batch_size,
            "losses": {key: _to_float(value) for key, value in values.items()},
            "grad_norm": grad_norm,
            "params_norm": params_norm,
            "num_zeros": num_zeros_in_grad,
            "loss_scale": loss_scale,
            "iteration_time_s": iteration_time,
            "tokens_per_s": batch_size * seq_len / iteration_time if iteration_time and seq_len else None,
            # loss tokens: Σloss_mask of the global batch (no padding, no prompt tokens of SFT data)
            "loss_tokens": loss_tokens,
            "loss_tokens_per_s": loss_tokens / iteration_time if iteration_time and loss_tokens is not None else None,
            "throughput": flops / iteration_time / get_world_size() / 1e12 if iteration_time and flops else None,
            "mfu": mfu(flops / iteration_time / get_world_size(), peak) if iteration_time and flops else None,
            "skipped_iterations": int(skipped_iter),
            "nan_iterations": int(got_nan),
        }
        metrics_logger.write(record)

    # ---- the text line every log_interval
    if iteration % log_interval == 0:
        elapsed_time = timers("interval-time", log_level=0).elapsed(barrier=True)
        if elapsed_time <= 0 and len(history_wct) > total_iterations:
            # The trainer did not run the interval timer: measure the interval from the wall-clock history.
            elapsed_time = history_wct[-1] - history_wct[-1 - total_iterations]
        elapsed_per_iter = elapsed_time / max(1, total_iterations)

        per_gpu_tflops = None if flops is None else 0.0
        if flops is not None and elapsed_time > 0:
            # FLOPs of this interval = growth of the trainer's running total since the last log; if the
            # trainer does not keep that total, the formula times the interval's iterations.
            interval_flops = so_far - global_state._flops_at_last_log
            if interval_flops <= 0:
                interval_flops = flops * total_iterations
            global_state._flops_at_last_log = so_far
            per_gpu_tflops = interval_flops / elapsed_time / get_world_size() / 1e12
            tokens = batch_size * seq_len * total_iterations if seq_len else 0
            _add_log_interval(global_state, iteration, total_iterations, elapsed_time, tokens, interval_flops)

        interval_scalars: dict[str, Any] = {}
        if _opt(logger_cfg, "log_timers_to_tensorboard", False):
            interval_scalars["iteration-time"] = elapsed_per_iter
        if per_gpu_tflops is not None and _opt(logger_cfg, "log_throughput", False):
            interval_scalars["throughput"] = per_gpu_tflops
        if any_sink:
            log_scalars(interval_scalars, iteration, **sinks)

        line = format_training_log_line(
            iteration=iteration,
            train_iters=train_cfg.train_iters,
            consumed_samples=consumed,
            skipped_samples=train_state.skipped_train_samples,
            elapsed_ms=elapsed_per_iter * 1000.0,
            throughput=per_gpu_tflops if _opt(logger_cfg, "log_throughput", False) else None,
            mfu=mfu(per_gpu_tflops * 1e12, peak) if per_gpu_tflops is not None else None,
            learning_rate=learning_rate,
            decoupled_learning_rate=decoupled_learning_rate,
            batch_size=batch_size,
            losses={
                key: _to_float(total_loss_dict[key]) / max(1, total_loss_dict[ADVANCED_ITERS_KEY])
                for key in total_loss_dict
                if key not in _COUNTER_KEYS
            },
            loss_scale=loss_scale,
            grad_norm=grad_norm,
            num_zeros_in_grad=num_zeros_in_grad,
            params_norm=params_norm,
            max_attention_logit=log_max_attention_logit,
            skipped_iterations=total_loss_dict[SKIPPED_ITERS_KEY],
            nan_iterations=total_loss_dict[NAN_ITERS_KEY],
        )
        for key in list(total_loss_dict):
            total_loss_dict[key] = 0 if key in _COUNTER_KEYS else 0.0
        print_rank_last(line)

        if report_memory_flag:
            report = report_memory(_opt(logger_cfg, "memory_keys"))
            dp_group = _opt(pg_collection, "dp")
            dp_rank = dist.get_rank(group=dp_group) if dp_group is not None and dist.is_initialized() else get_rank()
            if report and dp_rank == 0:
                text = f"(after {iteration} iterations) memory (GB)"
                for name, value in report.items():
                    text += f" | {name}: {value}"
                logger.info(f"[Rank {get_rank()}] {text}")
            if iteration > loaded_iteration + 1:
                # The report after the second iteration includes the optimizer state.
                report_memory_flag = False
        timers.log(timers_to_log, normalizer=log_interval)
    return report_memory_flag


def track_moe_metrics(model: list, config: Any, global_state: GlobalState, iteration: int) -> dict[str, float]:
    """Megatron's ``track_moe_metrics``: the MoE layers' metrics of the iteration just finished, then reset.

    Returns (empty for a dense model) ``load_balancing_loss`` and ``z_loss`` (when enabled; without their
    coefficients, averaged over microbatches, MoE layers and data-parallel ranks, as Megatron logs them) and
    ``load_imbalance``: per layer the busiest expert's token count over the mean count (1.0 = balanced; tokens
    summed over microbatches and data-parallel ranks), averaged over layers. With ``moe_per_layer_logging``
    each layer's values also go to the sinks as ``moe/<name>_layer_<i>`` every ``tensorboard_log_interval``.
    Collective over the pipeline and data-parallel groups: call on every rank.
    """
    model_cfg = getattr(config, "model", None)
    if not getattr(model_cfg, "num_moe_experts", None):
        return {}
    from longspan.models.moe import moe_layer_metrics, reset_moe_metrics

    chunks = model if isinstance(model, list) else [model]
    per_layer = moe_layer_metrics(chunks)
    reset_moe_metrics(chunks)
    num_layers, experts = int(model_cfg.num_layers), int(model_cfg.num_moe_experts)
    names = ["load_balancing_loss", "z_loss"]
    # [num_layers, 2 losses + steps + experts]: zeros for layers on other pipeline stages, summed across them.
    table = torch.zeros(num_layers, len(names) + 1 + experts, dtype=torch.float64)
    present = torch.zeros(len(names), dtype=torch.float64)
    for layer, values in per_layer.items():
        for j, name in enumerate(names):
            if name in values:
                table[layer, j] = values[name]
                present[j] = 1.0
        table[layer, len(names)] = values["steps"]
        table[layer, len(names) + 1:] = values["tokens_per_expert"]
    parallel = getattr(global_state, "parallel", None)
    if parallel is not None and dist.is_initialized():
        groups = [parallel.pp_group] if parallel.pp_size > 1 else []
        groups += [parallel.dp_group] if parallel.dp_size > 1 else []
        for group in groups:
            dist.all_reduce(table, group=group)
            dist.all_reduce(present, op=dist.ReduceOp.MAX, group=group)
    steps = table[:, len(names)]
    moe_rows = steps > 0
    if not bool(moe_rows.any()):
        return {}
    out: dict[str, float] = {}
    layer_values: dict[str, torch.Tensor] = {}
    for j, name in enumerate(names):
        if present[j] > 0:
            # steps were summed over dp ranks too, so sum/steps is the mean over microbatches and ranks
            layer_values[name] = table[moe_rows, j] / steps[moe_rows]
    tokens = table[moe_rows, len(names) + 1:]
    layer_values["load_imbalance"] = tokens.max(dim=1).values / tokens.mean(dim=1).clamp(min=1e-12)
    for name, vals in layer_values.items():
        out[name] = float(vals.mean())
    tb_interval = max(1, int(_opt(getattr(config, "logger", None), "tensorboard_log_interval", 1) or 1))
    if getattr(model_cfg, "moe_per_layer_logging", False) and iteration % tb_interval == 0:
        layer_ids = torch.nonzero(moe_rows).flatten().tolist()
        scalars = {f"moe/{name}_layer_{i}": float(v) for name, vals in layer_values.items()
                   for i, v in zip(layer_ids, vals.tolist())}
        log_scalars(scalars, iteration, **_sinks(global_state))
    return out


def format_training_log_line(
    *,
    iteration: int,
    train_iters: int,
    consumed_samples: int,
    elapsed_ms: float,
    batch_size: int,
    losses: dict[str, float],
    loss_scale: float,
    skipped_iterations: int,
    nan_iterations: int,
    skipped_samples: int = 0,
    throughput: Optional[float] = None,
    mfu: Optional[float] = None,
    learning_rate: Optional[float] = None,
    decoupled_learning_rate: Optional[float] = None,
    grad_norm: Optional[float] = None,
    num_zeros_in_grad: Optional[int] = None,
    params_norm: Optional[float] = None,
    max_attention_logit: Optional[float] = None,
    now: Optional[datetime] = None,
) -> str:
    """Megatron's training log line. Losses below zero (and NaN) are left out, as Megatron does."""
    s = f" [{(now or datetime.now()).strftime('%Y-%m-%d %H:%M:%S')}]"
    s += f" iteration {iteration:8d}/{train_iters or 0:8d} |"
    s += f" consumed samples: {consumed_samples:12d} |"
    if skipped_samples > 0:
        s += f" skipped samples: {skipped_samples:12d} |"
    s += f" elapsed time per iteration (ms): {elapsed_ms:.1f} |"
    if throughput is not None:
        s += f" throughput per GPU (TFLOP/s/GPU): {throughput:.1f} |"
    if mfu is not None:
        s += f" MFU: {100.0 * mfu:.1f}% |"
    if learning_rate is not None:
        s += f" learning rate: {learning_rate:.6E} |"
    if decoupled_learning_rate is not None:
        s += f" decoupled learning rate: {decoupled_learning_rate:.6E} |"
    s += f" global batch size: {batch_size:5d} |"
    for key, avg in losses.items():
        if avg >= 0.0:
            s += f" {key}: {avg:.6E} |"
    s += f" loss scale: {loss_scale:.1f} |"
    if grad_norm is not None:
        s += f" grad norm: {grad_norm:.3f} |"
    if num_zeros_in_grad is not None:
        s += f" num zeros: {num_zeros_in_grad} |"
    if params_norm is not None:
        s += f" params norm: {params_norm:.3f} |"
    if max_attention_logit is not None:
        s += f" max attention logit: {max_attention_logit:.3f} |"
    s += f" number of skipped iterations: {skipped_iterations:3d} |"
    s += f" number of nan iterations: {nan_iterations:3d} |"
    return s


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
    logger_cfg = getattr(cfg, "logger", None)
    log_ppl = bool(_opt(logger_cfg, "log_validation_ppl_to_tensorboard", False))
    consumed = global_state.train_state.consumed_train_samples
    sinks = _sinks(global_state)
    if not write_to_tensorboard:
        sinks["tb_writer"] = None
    losses = {key: _to_float(loss_value(v)) for key, v in loss_dict.items()}
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
    _write_vs_samples(sinks["tb_writer"], scalars, consumed)
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
