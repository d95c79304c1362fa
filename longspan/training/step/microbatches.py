"""How many microbatches make the current global batch (Megatron's num-microbatches calculators)."""

from __future__ import annotations

from longspan.core.errors import ConfigError
from longspan.core.logging import get_logger, print_rank_0

logger = get_logger(__name__)


def _decrease(global_batch_size: int, micro_times_dp: int) -> int:
    return max(micro_times_dp, (global_batch_size // micro_times_dp) * micro_times_dp)


class NumMicroBatchesCalculator:
    """Constant global batch, or Megatron's linear ramp-up (``rampup_batch_size = [start, incr, samples]``)."""

    def __init__(
        self,
        global_batch_size: int,
        micro_batch_size: int,
        data_parallel_size: int,
        rampup_batch_size: list[int] | None = None,
        decrease_batch_size_if_needed: bool = False,
    ) -> None:
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.data_parallel_size = data_parallel_size
        self.micro_times_dp = micro_batch_size * data_parallel_size
        self.decrease_batch_size_if_needed = decrease_batch_size_if_needed
        self.rampup = None
        if rampup_batch_size is not None:
            if len(rampup_batch_size) != 3:
                raise ConfigError(
                    f"train.rampup_batch_size={rampup_batch_size}: expected [start, increment, ramp_samples]"
                )
            start, increment, ramp_samples = (int(v) for v in rampup_batch_size)
            diff = global_batch_size - start
            if start <= 0 or increment <= 0 or ramp_samples < 0 or diff < 0 or diff % increment:
                raise ConfigError(
                    f"train.rampup_batch_size={rampup_batch_size}: need start > 0, increment > 0 and "
                    f"global_batch_size - start ({diff}) a non-negative multiple of the increment"
                )
            num_increments = diff // increment
            per_increment = ramp_samples / num_increments if num_increments else 0.0
            self.rampup = (start, increment, ramp_samples, per_increment)
        self.current_global_batch_size = global_batch_size
        self.num_micro_batches = 0
        self.update(0, consistency_check=False)

    def update(self, consumed_samples: int, consistency_check: bool = True) -> None:
        """Recompute the current global batch size for ``consumed_samples``."""
        if self.rampup is None or consumed_samples > self.rampup[2]:
            current = self.global_batch_size
        else:
            start, increment, _, per_increment = self.rampup
            steps = int(consumed_samples / per_increment) if per_increment else 0
            current = start + steps * increment
        if current % self.micro_times_dp:
            if self.decrease_batch_size_if_needed:
                decreased = _decrease(current, self.micro_times_dp)
                if decreased != self.current_global_batch_size:
                    print_rank_0(
                        f"global batch size {current} is not divisible by micro batch size × data parallel size "
                        f"({self.micro_times_dp}); using {decreased}",
                        logger,
                    )
                current = decreased
            elif consistency_check or self.rampup is None:
                raise ConfigError(
                    f"train.global_batch_size ({current}) must be divisible by micro_batch_size × data parallel "
                    f"size ({self.micro_batch_size} × {self.data_parallel_size}); "
                    "or set train.decrease_batch_size_if_needed=true"
                )
        self.current_global_batch_size = current
        self.num_micro_batches = max(1, current // self.micro_times_dp)

    def get(self) -> int:
        return self.num_micro_batches

    def get_current_global_batch_size(self) -> int:
        return self.current_global_batch_size
