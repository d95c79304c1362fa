"""``ddp.check_for_nan_in_grad`` and ``ddp.check_for_large_grads``: checks of the reduced gradients before the
optimizer step, with Megatron's semantics.

Megatron checks each rank's local norm of the reduced gradients once the gradient reduction is done. A NaN or
Inf norm stops the run; a "large" one is a norm at least ``LARGE_GRAD_FACTOR`` times the largest of the first
``LARGE_GRAD_SAMPLES`` norms seen (Megatron's ``is_unexpectedly_large``: those first norms only learn the
scale and are never flagged). Without the rerun state machine both are fatal in Megatron; so they are here:
one line naming the iteration, the rank and the norm. Under loss scaling (fp16) a non-finite gradient is the
overflow signal on which the scaler skips the step and lowers the scale, so the NaN/Inf check is left to it. The
verdict is agreed across ranks, so every rank stops
together instead of leaving its peers waiting in the next collective.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from longspan.training.step.loss_checks import TrainingDivergedError

LARGE_GRAD_FACTOR = 10.0
LARGE_GRAD_SAMPLES = 100


def local_grad_norm(model: list[torch.nn.Module]) -> float:
    """L2 norm of this rank's gradient values (its shards of DTensor gradients), in float32."""
    total = torch.zeros((), dtype=torch.float32)
    for chunk in model:
        for param in chunk.parameters():
            grad = param.grad
            if grad is None:
                continue
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            if local.numel():
                total += torch.linalg.vector_norm(local, ord=2, dtype=torch.float32).cpu() ** 2
    return float(total.sqrt())


class ReducedGradChecks:
    """The two switches of ``ddp`` and the running maximum the large-gradient check learns."""

    def __init__(self, check_for_nan: bool, check_for_large: bool) -> None:
        self.check_for_nan = check_for_nan
        self.check_for_large = check_for_large
        self.samples_seen = 0
        self.max_norm = 0.0

    @property
    def enabled(self) -> bool:
        return self.check_for_nan or self.check_for_large

    def _is_large(self, norm: float) -> bool:
        if not math.isfinite(norm):
            return False  # the NaN/Inf check's business
        if self.samples_seen < LARGE_GRAD_SAMPLES:
            self.samples_seen += 1
            self.max_norm = max(self.max_norm, norm)
            return False
        return norm >= self.max_norm * LARGE_GRAD_FACTOR

    def check(self, model: list[torch.nn.Module], iteration: int, rank: int, loss_scaling: bool = False) -> None:
        """Raise TrainingDivergedError when a rank's reduced gradients are NaN/Inf (unless ``loss_scaling``: the
        scaler skips such steps) or unexpectedly large."""
        if not self.enabled:
            return
        norm = local_grad_norm(model)
        flags = torch.tensor([
            1.0 if self.check_for_nan and not loss_scaling and not math.isfinite(norm) else 0.0,
            1.0 if self.check_for_large and self._is_large(norm) else 0.0,
        ])
        local_flags = flags.clone()
        if dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if flags[0] > 0:
            where = f"rank {rank} has gradient norm {norm}" if local_flags[0] > 0 else "another rank has them"
            raise TrainingDivergedError(
                f"ddp.check_for_nan_in_grad: NaN/Inf in the reduced gradients at iteration {iteration} ({where}); "
                "stopping before the optimizer step (lower optimizer.lr or enable gradient clipping)"
            )
        if flags[1] > 0:
            where = (f"rank {rank} has gradient norm {norm:.6g} >= {LARGE_GRAD_FACTOR:g} x {self.max_norm:.6g}, "
                     f"the largest of its first {LARGE_GRAD_SAMPLES}") if local_flags[1] > 0 else "on another rank"
            raise TrainingDivergedError(
                f"ddp.check_for_large_grads: unexpectedly large reduced gradients at iteration {iteration} ({where}); "
                "stopping before the optimizer step"
            )


def reduced_grad_checks(global_state: Any) -> ReducedGradChecks:
    """The run's checks, made on first use from ``cfg.ddp`` (they keep the large-gradient statistics)."""
    checks = getattr(global_state, "reduced_grad_checks", None)
    if checks is None:
        ddp = global_state.cfg.ddp
        checks = ReducedGradChecks(bool(ddp.check_for_nan_in_grad), bool(ddp.check_for_large_grads))
        global_state.reduced_grad_checks = checks
    return checks
