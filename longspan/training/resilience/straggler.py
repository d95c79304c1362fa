"""Straggler detection: ``straggler`` (Megatron's log_straggler) and ``nvrx_straggler`` on one detector.

Each rank times the compute part of every iteration (the train step: forward-backward and optimizer, measured
with ``time.perf_counter`` around it). Every report interval the ranks all-gather their mean step time since the
last report, and each rank gets two scores (1.0 = best):

- relative: the fastest rank's mean time / this rank's (``calc_relative_gpu_perf``);
- individual: this rank's best mean time in any earlier report / its current one (``calc_individual_gpu_perf``).

A rank whose relative score is below ``gpu_relative_perf_threshold`` or whose individual score is below
``gpu_individual_perf_threshold`` is a straggler. The log shows the best and worst ``num_gpu_perf_scores_to_print``
ranks (every report; with 0, only when stragglers are found); a straggler is a resilience event, and with
``stop_if_detected`` the run saves a checkpoint and ends cleanly.

Mapping: ``nvrx_straggler.enabled`` reports every ``report_time_interval`` seconds with its thresholds;
``straggler.log_straggler`` reports every ``logger.log_interval`` iterations, prints ``straggler_minmax_count``
ranks each way and has no thresholds (report only); it starts off with ``disable_straggler_on_startup`` and is
switched on and off at run time through rank 0's ``straggler_ctrlr_port`` (``straggler_control``; a switched-off
detector times nothing and reports nothing). Time-based reports are decided on rank 0 and broadcast, so
every rank joins the same collective; the clock is read every ``logger.log_interval`` iterations.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from longspan.config.schema.container import ConfigContainer


@dataclass
class StragglerSettings:
    """What the detector does, from either config section."""

    report_every_iterations: Optional[int] = None
    report_every_seconds: Optional[float] = None
    num_to_print: int = 1
    relative: bool = True
    individual: bool = True
    relative_threshold: Optional[float] = None
    individual_threshold: Optional[float] = None
    stop_if_detected: bool = False
    enabled_at_start: bool = True
    control_port: Optional[int] = None  #: rank 0 listens here for run-time toggles (None: no listener)


def straggler_settings(cfg: ConfigContainer) -> Optional[StragglerSettings]:
    """The detector's settings, or None when neither section turns it on (nvrx_straggler wins when both do)."""
    nvrx = cfg.nvrx_straggler
    if nvrx is not None and nvrx.enabled:
        return StragglerSettings(
            report_every_seconds=float(nvrx.report_time_interval), num_to_print=int(nvrx.num_gpu_perf_scores_to_print),
            relative=bool(nvrx.calc_relative_gpu_perf), individual=bool(nvrx.calc_individual_gpu_perf),
            relative_threshold=float(nvrx.gpu_relative_perf_threshold),
            individual_threshold=float(nvrx.gpu_individual_perf_threshold), stop_if_detected=bool(nvrx.stop_if_detected),
        )
    megatron = cfg.straggler
    if megatron is not None and megatron.log_straggler:
        return StragglerSettings(report_every_iterations=int(cfg.logger.log_interval or 1),
                                 num_to_print=int(megatron.straggler_minmax_count),
                                 enabled_at_start=not megatron.disable_straggler_on_startup,
                                 control_port=megatron.straggler_ctrlr_port)
    return None


@dataclass
class StragglerReport:
    """One report: per-rank mean step time and scores, and who straggles."""

    iteration: int
    mean_step_s: list[float]
    relative: Optional[list[float]]
    individual: Optional[list[float]]
    stragglers: list[int]

    def ranked(self, scores: list[float], n: int) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
        order = sorted(range(len(scores)), key=lambda r: (-scores[r], r))
        best = [(r, scores[r]) for r in order[:n]]
        worst = [(r, scores[r]) for r in reversed(order[-n:])] if n else []
        return best, worst


class StragglerDetector:
    """Per-rank step timing and periodic, collective scoring (see the module docstring)."""

    def __init__(self, settings: StragglerSettings, *, check_every: int = 1, device: Any = "cpu") -> None:
        self.settings = settings
        self.check_every = max(1, int(check_every))  # time-based reports: look at the clock this often
        self.device = device
        self.total_s = 0.0
        self.count = 0
        self.best_mean_s: Optional[float] = None  # this rank's best earlier mean (individual reference)
        self.last_report = time.monotonic()
        self._started: Optional[float] = None
        self.enabled = settings.enabled_at_start  #: switched on every rank together (straggler_control)

    def set_enabled(self, enabled: bool) -> None:
        """Switch timing and reports on or off; a new period starts either way."""
        self.enabled = enabled
        self.total_s, self.count, self._started = 0.0, 0, None
        self.last_report = time.monotonic()

    def iteration_started(self) -> None:
        if self.enabled:
            self._started = time.perf_counter()

    def iteration_done(self) -> None:
        if self._started is not None:
            self.total_s += time.perf_counter() - self._started
            self.count += 1
            self._started = None

    def _due(self, iteration: int) -> bool:
        s = self.settings
        if s.report_every_iterations:
            return iteration % s.report_every_iterations == 0
        if iteration % self.check_every:
            return False
        due = torch.tensor([int(time.monotonic() - self.last_report >= (s.report_every_seconds or 0.0))],
                           device=self.device)
        if dist.is_initialized():
            dist.broadcast(due, src=0)  # rank 0's clock decides, so every rank joins the gather below
        return bool(due.item())

    def maybe_report(self, iteration: int) -> Optional[StragglerReport]:
        """Collective on every rank at the same iterations: a report when one is due, else None (always None
        while switched off)."""
        if not self.enabled or not self._due(iteration):
            return None
        self.last_report = time.monotonic()
        mean = self.total_s / self.count if self.count else 0.0
        individual_mine = (self.best_mean_s / mean) if (self.best_mean_s and mean > 0) else 1.0
        if mean > 0:
            self.best_mean_s = mean if self.best_mean_s is None else min(self.best_mean_s, mean)
        self.total_s, self.count = 0.0, 0
        local = torch.tensor([mean, individual_mine], dtype=torch.float64, device=self.device)
        if dist.is_initialized():
            gathered = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, local)
        else:
            gathered = [local]
        means = [float(g[0]) for g in gathered]
        s = self.settings
        fastest = min((m for m in means if m > 0), default=0.0)
        relative = [fastest / m if m > 0 else 1.0 for m in means] if s.relative else None
        individual = [float(g[1]) for g in gathered] if s.individual else None
        stragglers = set()
        if relative is not None and s.relative_threshold is not None:
            stragglers |= {r for r, v in enumerate(relative) if v < s.relative_threshold}
        if individual is not None and s.individual_threshold is not None:
            stragglers |= {r for r, v in enumerate(individual) if v < s.individual_threshold}
        return StragglerReport(iteration, means, relative, individual, sorted(stragglers))

    def format(self, report: StragglerReport) -> list[str]:
        """The log lines of a report (the best/worst ranks of each score)."""
        n = self.settings.num_to_print
        if n == 0 and not report.stragglers:
            return []
        n = n or len(report.stragglers)
        lines = []
        for name, scores in (("relative", report.relative), ("individual", report.individual)):
            if scores is None:
                continue
            best, worst = report.ranked(scores, n)
            fmt = lambda pairs: ", ".join(f"rank {r}: {v:.2f}" for r, v in pairs)  # noqa: E731
            lines.append(f"straggler: {name} performance scores at iteration {report.iteration}: best [{fmt(best)}], "
                         f"worst [{fmt(worst)}]")
        slowest = max(range(len(report.mean_step_s)), key=lambda r: report.mean_step_s[r])
        lines.append(f"straggler: mean step time {min(report.mean_step_s) * 1e3:.1f}-{max(report.mean_step_s) * 1e3:.1f} "
                     f"ms (slowest rank {slowest})")
        return lines
