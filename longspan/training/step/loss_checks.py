"""Checks and scales shared by both forward-backward schedules (schedules.py, pipeline_schedules.py).

Kept in their own module so the two schedule modules do not import each other.
"""

from __future__ import annotations

from typing import Callable

import torch

from longspan.core.errors import LongspanError
from longspan.models.moe_router import set_aux_loss_scale
from longspan.models.mtp import set_mtp_loss_scale


class TrainingDivergedError(LongspanError):
    """The loss or the gradients became NaN or Inf; the run stops before anything is checkpointed."""

    exit_code = 1


def check_finite(value: torch.Tensor, what: str, iteration: int | None) -> None:
    """Raise TrainingDivergedError when ``value`` holds NaN or Inf (``what`` names it in the message)."""
    if not torch.isfinite(value).all():
        where = f" at iteration {iteration}" if iteration is not None else ""
        raise TrainingDivergedError(
            f"{what} is NaN or Inf{where}; stopping before the optimizer step "
            "(lower optimizer.lr, enable gradient clipping, or use bf16_mixed instead of fp16)"
        )


def set_moe_aux_loss_scale(
    grad_scale_func: Callable[[torch.Tensor], torch.Tensor] | None, num_microbatches: int, calculate_per_token_loss: bool
) -> None:
    """MoE aux losses and the multi-token-prediction loss add their gradient in backward, scaled like the LM
    loss (Megatron's schedules do this)."""
    loss_scale = float(grad_scale_func(torch.ones(())).item()) if grad_scale_func is not None else 1.0
    scale = loss_scale if calculate_per_token_loss else loss_scale / num_microbatches
    set_aux_loss_scale(scale)
    set_mtp_loss_scale(scale)
