"""What one training iteration reports to the training log, and its accumulation over a log interval."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch

ADVANCED_ITERS_KEY = "advanced iterations"
SKIPPED_ITERS_KEY = "skipped iterations"
NAN_ITERS_KEY = "nan iterations"
COUNTER_KEYS = (ADVANCED_ITERS_KEY, SKIPPED_ITERS_KEY, NAN_ITERS_KEY)


@dataclass
class IterationMetrics:
    """The numbers of the iteration just finished, as the trainer hands them to ``training_log``."""

    loss_dict: dict[str, Any]
    """Reported losses ({name: float | 0-d tensor | [sum, count] tensor})."""

    learning_rate: Optional[float]
    """Current learning rate (None on ranks without parameters)."""

    loss_scale: float = 1.0
    """Current loss scale (1.0 without fp16)."""

    skipped_iter: int = 0
    """1 if the optimizer skipped this iteration (fp16 overflow), else 0."""

    grad_norm: Optional[float] = None
    """Gradient norm, or None."""

    params_norm: Optional[float] = None
    """Parameter norm (``logger.log_params_norm``), or None."""

    num_zeros_in_grad: Optional[int] = None
    """Number of zeros in the gradient (``optimizer.log_num_zeros_in_grad``), or None."""

    decoupled_learning_rate: Optional[float] = None
    """Learning rate of the decoupled parameters (``optimizer.decoupled_lr``), or None."""

    max_attention_logit: Optional[float] = None
    """Maximum attention logit, if tracked."""

    seq_length: Optional[int] = None
    """Sequence length of this iteration's batch (None: ``model.seq_length``)."""

    extra_values: dict[str, float] = field(default_factory=dict)
    """More per-iteration values logged like losses (MoE aux losses and load imbalance)."""


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


def to_float(value: Union[float, torch.Tensor]) -> float:
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)


def accumulate(total_loss_dict: dict[str, Any], values: dict[str, Any], skipped_iter: int) -> bool:
    """Add the iteration into the interval's accumulators; True when a skipped iteration's loss is NaN/Inf.

    Skipped iterations are counted but not averaged in (Megatron); a non-finite loss of a skipped iteration
    counts as a nan iteration.
    """
    if not skipped_iter:
        total_loss_dict[ADVANCED_ITERS_KEY] = total_loss_dict.get(ADVANCED_ITERS_KEY, 0) + 1
    else:
        total_loss_dict.setdefault(ADVANCED_ITERS_KEY, 0)
    total_loss_dict[SKIPPED_ITERS_KEY] = total_loss_dict.get(SKIPPED_ITERS_KEY, 0) + int(skipped_iter)
    got_nan = False
    for key, value in values.items():
        if not skipped_iter:
            total_loss_dict[key] = total_loss_dict.get(key, 0.0) + value
        else:
            got_nan = got_nan or not math.isfinite(to_float(value))
    total_loss_dict[NAN_ITERS_KEY] = total_loss_dict.get(NAN_ITERS_KEY, 0) + int(got_nan)
    return got_nan


def interval_means(total_loss_dict: dict[str, Any]) -> dict[str, float]:
    """Each accumulated loss averaged over the interval's advanced iterations."""
    advanced = max(1, total_loss_dict.get(ADVANCED_ITERS_KEY, 0))
    return {key: to_float(value) / advanced for key, value in total_loss_dict.items() if key not in COUNTER_KEYS}


def reset(total_loss_dict: dict[str, Any]) -> None:
    for key in list(total_loss_dict):
        total_loss_dict[key] = 0 if key in COUNTER_KEYS else 0.0
