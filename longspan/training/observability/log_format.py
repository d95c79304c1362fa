"""Megatron's training log line as text (no I/O): ``format_training_log_line``."""

from __future__ import annotations

from datetime import datetime
from typing import Optional

from longspan.planner.peak_flops import format_mfu


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
    energy: Optional[dict[str, float]] = None,
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
        s += f" MFU: {format_mfu(mfu)} |"
    if energy is not None:
        s += f" energy per GPU (J/iter/GPU): {energy['energy_per_gpu_j_per_iter']:.1f} |"
        s += f" power per GPU (W/GPU): {energy['power_per_gpu_w']:.1f} |"
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
