"""Megatron-style named timers.

``Timers`` hands out named timers. Each timer has a log level (0: once per iteration, 1: a few times per
iteration, 2: many times per iteration); a timer whose level is above the configured ``timing_log_level``
is a shared no-op ``DummyTimer``, so fine-grained timing costs nothing unless asked for. Timers synchronize
CUDA only when this process uses CUDA, and gather across ranks only when torch.distributed is initialized.

The API mirrors megatron-core's ``megatron.core.timers.Timers`` (``timers(name, log_level)``,
``start/stop/elapsed/active_time``, ``log``, ``write``) and prints the same strings.
"""

from __future__ import annotations

import time
from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist

from longspan.core.errors import ConfigError
from longspan.core.logging import get_logger
from longspan.training.utils.comm import collective_device, cuda_synchronize_if_used, dist_ready

logger = get_logger(__name__)

LOG_OPTIONS = ("max", "minmax", "all")
MAX_LOG_LEVEL = 2


class DummyTimer:
    """A timer that does nothing: returned for timers above the configured log level."""

    name = "dummy"

    def start(self, barrier: bool = False) -> None:
        """No-op."""

    def stop(self, barrier: bool = False) -> None:
        """No-op."""

    def reset(self) -> None:
        """No-op."""

    def elapsed(self, reset: bool = True, barrier: bool = False) -> float:
        """Refuse: a disabled timer has no time to report (Megatron raises here too)."""
        raise RuntimeError(
            "dummy timer should not be used to calculate elapsed time; "
            "check that the timer's log_level <= logger.timing_log_level"
        )

    def active_time(self) -> float:
        """Refuse, as ``elapsed``."""
        raise RuntimeError(
            "dummy timer should not be used to calculate active time; "
            "check that the timer's log_level <= logger.timing_log_level"
        )


class Timer:
    """A start/stop wall-clock timer that accumulates elapsed seconds.

    ``barrier=True`` makes every rank of ``barrier_group`` (the default group when None) wait for the others
    first; every rank in the group must then make the same call.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._elapsed = 0.0
        self._active_time = 0.0
        self._started = False
        self._barrier_group: Optional[Any] = None
        self._start_time = time.time()

    def set_barrier_group(self, barrier_group: Optional[Any]) -> None:
        """Use ``barrier_group`` for ``barrier=True`` calls instead of the default group."""
        self._barrier_group = barrier_group

    def _barrier(self, barrier: bool) -> None:
        if barrier and dist_ready():
            dist.barrier(group=self._barrier_group)

    def start(self, barrier: bool = False) -> None:
        """Start timing. Starting a running timer is a bug and raises."""
        if self._started:
            raise RuntimeError(f"timer '{self.name}' has already been started")
        self._barrier(barrier)
        cuda_synchronize_if_used()
        self._start_time = time.time()
        self._started = True

    def stop(self, barrier: bool = False) -> None:
        """Stop timing and add the interval to the elapsed and active totals."""
        if not self._started:
            raise RuntimeError(f"timer '{self.name}' is not started")
        self._barrier(barrier)
        cuda_synchronize_if_used()
        interval = time.time() - self._start_time
        self._elapsed += interval
        self._active_time += interval
        self._started = False

    def reset(self) -> None:
        """Zero the elapsed total (the active total keeps counting) and mark the timer stopped."""
        self._elapsed = 0.0
        self._started = False

    def set_elapsed(self, value: float) -> None:
        """Overwrite the elapsed total, e.g. to report a start-up duration measured elsewhere."""
        self._elapsed = float(value)

    def elapsed(self, reset: bool = True, barrier: bool = False) -> float:
        """Seconds accumulated so far; a running timer keeps running. ``reset`` zeroes the total."""
        running = self._started
        if running:
            self.stop(barrier=barrier)
        value = self._elapsed
        if reset:
            self.reset()
        if running:
            self.start(barrier=barrier)
        return value

    def active_time(self) -> float:
        """Total seconds this timer has been running since creation (never reset)."""
        return self._active_time


class Timers:
    """A group of named timers with Megatron's logging options.

    Args:
        log_level: the largest timer level that is really timed (``logger.timing_log_level``, 0-2).
        log_option: how times are summarized across ranks (``logger.timing_log_option``): ``max``,
            ``minmax`` or ``all``.
    """

    def __init__(self, log_level: int, log_option: str) -> None:
        if log_option not in LOG_OPTIONS:
            raise ConfigError(
                f"logger.timing_log_option={log_option!r} is not valid; use one of {', '.join(LOG_OPTIONS)}"
            )
        if not isinstance(log_level, int) or not 0 <= log_level <= MAX_LOG_LEVEL:
            raise ConfigError(f"logger.timing_log_level={log_level!r} is not valid; use 0, 1 or 2")
        self._log_level = log_level
        self._log_option = log_option
        self._timers: dict[str, Timer] = {}
        self._log_levels: dict[str, int] = {}
        self._dummy_timer = DummyTimer()

    @property
    def log_level(self) -> int:
        """The configured timing log level."""
        return self._log_level

    @property
    def log_option(self) -> str:
        """The configured cross-rank summary option."""
        return self._log_option

    def __call__(self, name: str, log_level: Optional[int] = None) -> Timer | DummyTimer:
        """The timer called ``name``, created on first use.

        A new timer without ``log_level`` gets the maximum level (2), as in Megatron. Asking for an existing
        timer with a different level is a bug and raises. Timers above the configured level are a shared
        ``DummyTimer``.
        """
        if name in self._timers:
            if log_level is not None and log_level != self._log_levels[name]:
                raise RuntimeError(
                    f"timer '{name}' was created with log level {self._log_levels[name]}, not {log_level}"
                )
            return self._timers[name]
        if log_level is None:
            log_level = MAX_LOG_LEVEL
        if log_level > MAX_LOG_LEVEL:
            raise RuntimeError(f"timer log level {log_level} is larger than the maximum {MAX_LOG_LEVEL}")
        if log_level > self._log_level:
            return self._dummy_timer
        timer = Timer(name)
        self._timers[name] = timer
        self._log_levels[name] = log_level
        return timer

    def names(self) -> list[str]:
        """Names of the real (not dummy) timers created so far."""
        return list(self._timers)

    # ------------------------------------------------------------------ gathering across ranks
    def _elapsed_all_ranks(self, names: list[str], reset: bool, barrier: bool) -> torch.Tensor:
        """A ``[world_size, len(names)]`` tensor of elapsed seconds (0 where a rank lacks the timer).

        Every rank must call this with the same ``names`` when torch.distributed is initialized.
        """
        if barrier and dist_ready():
            dist.barrier()
        world_size = dist.get_world_size() if dist_ready() else 1
        device = collective_device()
        local = torch.zeros(len(names), dtype=torch.float64, device=device)
        for i, name in enumerate(names):
            if name in self._timers:
                local[i] = self._timers[name].elapsed(reset=reset)
        if world_size == 1:
            return local.unsqueeze(0).cpu()
        gathered = [torch.zeros_like(local) for _ in range(world_size)]
        dist.all_gather(gathered, local)
        return torch.stack(gathered).cpu()

    def _min_max_times(
        self, names: list[str], reset: bool, barrier: bool, normalizer: float
    ) -> dict[str, tuple[float, float]]:
        """(min, max) over the ranks that recorded time, divided by ``normalizer``, per timer."""
        if not names:
            return {}
        per_rank = self._elapsed_all_ranks(names, reset, barrier).t().tolist()
        result: dict[str, tuple[float, float]] = {}
        for name, times in zip(names, per_rank):
            recorded = [t for t in times if t > 0.0]
            if recorded:
                result[name] = (min(recorded) / normalizer, max(recorded) / normalizer)
        return result

    # ------------------------------------------------------------------ reports
    def get_all_timers_string(
        self,
        names: Optional[Iterable[str]] = None,
        normalizer: float = 1.0,
        reset: bool = True,
        barrier: bool = False,
    ) -> Optional[str]:
        """Megatron's timing report for ``names`` (all real timers when None), in milliseconds.

        Returns None when none of the timers recorded any time.
        """
        if normalizer <= 0.0:
            raise ValueError(f"normalizer must be positive, got {normalizer}")
        names = list(self._timers) if names is None else list(names)
        # Seconds / (normalizer / 1000) = milliseconds per normalizer unit.
        scale = normalizer / 1000.0
        if not dist_ready() or dist.get_world_size() == 1:  # one process: no ranks to compare
            min_max = self._min_max_times(names, reset, barrier, scale)
            if not min_max:
                return None
            return "time (ms):" + "".join(f"\n    {(name + ' ').ljust(48, '.')}: {hi:.2f}"
                                          for name, (_, hi) in min_max.items())
        if self._log_option in ("max", "minmax"):
            min_max = self._min_max_times(names, reset, barrier, scale)
            if not min_max:
                return None
            max_only = self._log_option == "max"
            out = "max time across ranks (ms):" if max_only else "(min, max) time across ranks (ms):"
            for name, (lo, hi) in min_max.items():
                label = (name + " ").ljust(48, ".")
                out += f"\n    {label}: {hi:.2f}" if max_only else f"\n    {label}: ({lo:.2f}, {hi:.2f})"
            return out
        # "all": one line per rank that recorded the timer.
        if not names:
            return None
        table = self._elapsed_all_ranks(names, reset, barrier)
        out = "times across ranks (ms):"
        any_time = False
        for i, name in enumerate(names):
            header_written = False
            for rank in range(table.shape[0]):
                value = float(table[rank, i])
                if value > 0:
                    any_time = True
                    if not header_written:
                        out += f"\n  {name}:"
                        header_written = True
                    out += f"\n     rank {rank:2d}: {value / scale:.2f}"
        return out if any_time else None

    def log(
        self,
        names: Optional[Iterable[str]],
        rank: Optional[int] = None,
        normalizer: float = 1.0,
        reset: bool = True,
        barrier: bool = False,
    ) -> Optional[str]:
        """Log the timing report on ``rank`` (the last rank when None) and return it.

        Every rank must call this (it gathers across ranks when distributed). The string is returned on
        every rank; only ``rank`` logs it.
        """
        text = self.get_all_timers_string(names, normalizer, reset, barrier)
        world_size = dist.get_world_size() if dist_ready() else 1
        my_rank = dist.get_rank() if dist_ready() else 0
        target = world_size - 1 if rank is None else rank
        if text is not None and my_rank == target:
            logger.info(text)
        return text

    def write(
        self,
        names: Iterable[str],
        writer: Any,
        iteration: int,
        normalizer: float = 1.0,
        reset: bool = False,
        barrier: bool = False,
    ) -> dict[str, float]:
        """Write the max time across ranks of each timer to ``writer`` as ``{name}-time`` (seconds).

        ``writer`` is a TensorBoard ``SummaryWriter`` (``add_scalar``) or a W&B-style object (``log``), or
        None to only gather. Every rank must call this. Returns ``{name}-time -> value``.
        """
        if normalizer <= 0.0:
            raise ValueError(f"normalizer must be positive, got {normalizer}")
        min_max = self._min_max_times(list(names), reset, barrier, normalizer)
        values = {f"{name}-time": hi for name, (_, hi) in min_max.items()}
        if writer is not None:
            for tag, value in values.items():
                if hasattr(writer, "add_scalar"):
                    writer.add_scalar(tag, value, iteration)
                elif hasattr(writer, "log"):
                    writer.log({tag: value}, iteration)
        return values
