"""The rerun state machine (``rerun_state_machine``): validate each iteration's result, re-run suspicious
iterations in place with the same data and RNG, and tell a transient fault from a reproducible one.

Semantics follow megatron-core's ``rerun_state_machine.py`` (written anew: megatron's needs CUDA):

- ``validate_results``: the iteration's local loss is checked (NaN/Inf: fatal; spiky, with
  ``check_for_spiky_loss``: not fatal). A rejected result re-runs the forward-backward in place with the same
  microbatches (replayed) and the RNG state of the iteration's start.
  - different result → a transient fault: save a checkpoint (of the previous iteration) and exit 17;
  - same result → save and exit 16, so that the job resumes on other hardware, where the iteration runs a
    third time: same result again → "correct result (possible application error)", different → "persistent
    fault"; both exit 17 (fatal). Resumed on the same hardware, it exits 16 again.
  - non-fatal checks (spiky loss) continue after the in-place re-run whatever it shows.
- ``report_stats``: every iteration runs twice; the relative difference of the two results is collected and
  reported every ``logger.log_interval`` iterations.
- ``error_injection_rate`` / ``error_injection_type`` inject a rejected result once every that many validations
  and make the re-runs compare as the type says (correct_result, transient_error, persistent_error).

"Other hardware" is the triple (node name, local device, global rank): the node name is ``LONGSPAN_NODE_NAME``,
else ``SLURMD_NODENAME``, else the host name; the device is ``cuda:<index>`` or ``cpu``. A resumed run whose
suspicious rank has a different triple is on other hardware.
"""

from __future__ import annotations

import math
import os
import pickle
import random
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import numpy as np
import torch
import torch.distributed as dist

from longspan.core.logging import get_logger

logger = get_logger(__name__)

EXIT_CODE_RESUME_TO_DISAMBIGUATE = 16
EXIT_CODE_FAILED_ON_RESULT_VALIDATION = 17

NOT_RUNNING_YET = "not_running_yet"
INITIAL_RUN = "initial_run"
RERUNNING_IN_PLACE = "rerunning_in_place"
WILL_RERUN_FROM_CHECKPOINT = "will_rerun_from_checkpoint"
RERUNNING_FROM_CHECKPOINT = "rerunning_from_checkpoint"
RERUNNING_AGAIN_FROM_CHECKPOINT = "rerunning_again_from_checkpoint"

#: verdicts (also the ``verdict`` field of the metrics.jsonl record)
TRANSIENT_FAULT = "transient_fault"
REPRODUCIBLE_NEEDS_OTHER_HARDWARE = "reproducible_rerun_on_other_hardware"
CORRECT_RESULT = "correct_result"
PERSISTENT_FAULT = "persistent_fault"
SAME_HARDWARE = "rescheduled_on_same_hardware"
NOT_FATAL = "not_fatal_continue"


def hardware_id(rank: Optional[int] = None) -> str:
    """``node/device/rank``: what "other hardware" is compared on (see the module docstring)."""
    node = os.environ.get("LONGSPAN_NODE_NAME") or os.environ.get("SLURMD_NODENAME") or os.uname().nodename
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        device = f"cuda:{torch.cuda.current_device()}"
    else:
        device = "cpu"
    rank = (dist.get_rank() if dist.is_initialized() else 0) if rank is None else rank
    return f"{node}/{device}/rank{rank}"


def _reduce_any(flags: list[bool]) -> list[bool]:
    if not dist.is_initialized():
        return flags
    t = torch.tensor([int(f) for f in flags], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [bool(v) for v in t.tolist()]


def relative_difference(a: float, b: float) -> float:
    """0 for equal values (NaN equals NaN), inf for a finite/non-finite mismatch, else |a-b| / mean(|a|,|b|)."""
    if a == b or (math.isnan(a) and math.isnan(b)):
        return 0.0
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max((abs(a) + abs(b)) / 2, 1e-30)


class ReplayableIterator:
    """Wraps a data iterator: remembers the batches of the current iteration so a re-run reads them again."""

    def __init__(self, iterator: Iterator) -> None:
        self.iterator = iterator
        self.buffer: list[Any] = []
        self.position: Optional[int] = None  # replaying from buffer[position] when not None

    def __iter__(self) -> "ReplayableIterator":
        return self

    def __next__(self) -> Any:
        if self.position is not None and self.position < len(self.buffer):
            self.position += 1
            return self.buffer[self.position - 1]
        batch = next(self.iterator)
        self.buffer.append(batch)
        return batch

    def advance(self) -> None:
        """A new iteration: forget the previous one's batches."""
        self.buffer.clear()
        self.position = None

    def rewind(self) -> None:
        """Read this iteration's batches again from the first."""
        self.position = 0


@dataclass
class _Injector:
    rate: int = 0
    kind: str = "transient_error"
    rng: random.Random = field(default_factory=lambda: random.Random(1234))
    injected: Optional[str] = None  # the type of the injection in progress

    def maybe_inject(self, rank: int) -> bool:
        if self.rate <= 0 or self.injected is not None:
            return False
        if (self.rng.randrange(self.rate) + rank) % self.rate != 0:
            return False
        self.injected = self.kind
        logger.warning(f"rerun state machine: injecting a {self.kind} (rerun_state_machine.error_injection_type)")
        return True

    def compare(self, initial: float, result: float, state: str) -> float:
        """The comparison the re-run sees: the true one, or the injected outcome."""
        if self.injected is None:
            return relative_difference(initial, result)
        if state == RERUNNING_IN_PLACE:
            if self.injected == "transient_error":
                self.injected = None
                return math.inf
            return 0.0
        verdict = math.inf if self.injected == "persistent_error" else 0.0
        self.injected = None
        return verdict


class RerunStateMachine:
    """Drives the re-runs of ``train_step`` (see the module docstring). One per process."""

    def __init__(self, cfg: Any, *, report_interval: int = 1) -> None:
        self.mode: str = cfg.rerun_mode
        self.check_for_nan = bool(cfg.check_for_nan_in_loss)
        self.check_for_spiky_loss = bool(cfg.check_for_spiky_loss)
        self.spiky_loss_factor = float(cfg.spiky_loss_factor)
        self.spiky_num_samples = 100  # Megatron: the running max is learned from the first 100 losses
        self.report_interval = max(1, int(report_interval))
        self.injector = _Injector(cfg.error_injection_rate, cfg.error_injection_type)
        self.state = NOT_RUNNING_YET
        self.current_iteration = 0
        self.first_iteration_complete = False
        self._reset_flags()
        self.initial_result: Optional[float] = None
        self.failed_check: Optional[str] = None
        self.failed_fatal = True
        self.suspicious_hardware: Optional[str] = None
        self.max_loss = 0.0
        self.loss_count = 0
        self.saved_rng: Optional[dict[str, Any]] = None
        self.iterators: list[ReplayableIterator] = []
        self.stats: list[float] = []  # report_stats: relative differences since the last report
        self.events: list[dict[str, Any]] = []  # what happened, for the trainer to report

    def _reset_flags(self) -> None:
        self.rerun_requested = False
        self.checkpoint_requested = False
        self.restart_again_requested = False
        self.continue_requested = False
        self.rerun_result: Optional[float] = None

    @property
    def enabled(self) -> bool:
        return self.mode != "disabled"

    # ------------------------------------------------------------------------------------ data + RNG
    def wrap_data_iterator(self, data_iterator: Any) -> Any:
        """The data iterator(s) the trainer must use: replayable when the machine re-runs iterations."""
        if not self.enabled or data_iterator is None:
            return data_iterator
        if isinstance(data_iterator, list):
            self.iterators = [ReplayableIterator(d) if d is not None else None for d in data_iterator]
            return self.iterators
        self.iterators = [ReplayableIterator(data_iterator)]
        return self.iterators[0]

    def _save_rng(self) -> None:
        self.saved_rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self.saved_rng["cuda"] = torch.cuda.get_rng_state_all()

    def _restore_rng_and_rewind(self) -> None:
        assert self.saved_rng is not None
        random.setstate(self.saved_rng["python"])
        np.random.set_state(self.saved_rng["numpy"])
        torch.set_rng_state(self.saved_rng["torch"])
        if "cuda" in self.saved_rng:
            torch.cuda.set_rng_state_all(self.saved_rng["cuda"])
        for it in self.iterators:
            if it is not None:
                it.rewind()

    # --------------------------------------------------------------------------------- the protocol
    def should_run_forward_backward(self) -> bool:
        """True while the trainer must (re)run the forward-backward of this iteration."""
        if self.state == NOT_RUNNING_YET:
            self.current_iteration += 1
            self.state = INITIAL_RUN
            if self.enabled:
                self._reset_flags()
                self._save_rng()
                for it in self.iterators:
                    if it is not None:
                        it.advance()
            return True
        if self.state == INITIAL_RUN:
            if not self.enabled or not _reduce_any([self.rerun_requested])[0]:
                self.state = NOT_RUNNING_YET
                return False
            self.state = RERUNNING_IN_PLACE
            self._restore_rng_and_rewind()
            return True
        if self.state == RERUNNING_IN_PLACE:
            if self.mode == "report_stats":
                self.state = NOT_RUNNING_YET
                return False
            will_continue, will_checkpoint = _reduce_any([self.continue_requested, self.checkpoint_requested])
            if will_continue:
                self.state = NOT_RUNNING_YET
                return False
            if will_checkpoint:
                self.state = WILL_RERUN_FROM_CHECKPOINT
            self._restore_rng_and_rewind()  # the checkpoint holds the iteration's starting RNG state
            return False
        if self.state == WILL_RERUN_FROM_CHECKPOINT:  # resumed from the checkpoint of exit 16
            self.state = RERUNNING_FROM_CHECKPOINT
            return True
        if self.state == RERUNNING_FROM_CHECKPOINT:
            again, will_continue = _reduce_any([self.restart_again_requested, self.continue_requested])
            if again:
                self.state = RERUNNING_AGAIN_FROM_CHECKPOINT
            elif will_continue:
                self.state = NOT_RUNNING_YET
            return False
        raise RuntimeError(f"rerun state machine: unexpected state {self.state}")

    def should_checkpoint_and_exit(self) -> tuple[bool, bool, int]:
        """(save a checkpoint, exit, exit code) once the forward-backward loop is over."""
        self.first_iteration_complete = True
        if self.mode != "validate_results":
            return False, False, 0
        if self.state == RERUNNING_IN_PLACE:
            return True, True, EXIT_CODE_FAILED_ON_RESULT_VALIDATION
        if self.state == WILL_RERUN_FROM_CHECKPOINT:
            return True, True, EXIT_CODE_RESUME_TO_DISAMBIGUATE
        if self.state == RERUNNING_FROM_CHECKPOINT:
            return False, True, EXIT_CODE_FAILED_ON_RESULT_VALIDATION
        if self.state == RERUNNING_AGAIN_FROM_CHECKPOINT:
            return False, True, EXIT_CODE_RESUME_TO_DISAMBIGUATE
        return False, False, 0

    # ------------------------------------------------------------------------------------ validation
    def validate_reports(self, reports: list[dict[str, Any]]) -> None:
        """Validate this rank's loss of the forward-backward run that produced ``reports`` (no-op when off)."""
        if self.enabled or self.check_for_spiky_loss:
            self.validate_loss(local_loss(reports))

    def _is_spiky(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        value = abs(value)
        if self.loss_count < self.spiky_num_samples:
            self.loss_count += 1
            self.max_loss = max(self.max_loss, value)
            return False
        return value >= self.max_loss * self.spiky_loss_factor

    def validate_loss(self, value: float) -> None:
        """Check this rank's loss of the iteration (called after each forward-backward run)."""
        if self.mode == "report_stats":
            if self.state == INITIAL_RUN:
                self.rerun_requested = True
                self.initial_result = value
            elif self.state == RERUNNING_IN_PLACE:
                self.stats.append(relative_difference(self.initial_result, value))
            return
        if self.state == INITIAL_RUN:
            nan = self.check_for_nan and not math.isfinite(value)
            spiky = self.check_for_spiky_loss and self._is_spiky(value)
            if not self.enabled:
                if spiky:
                    self._event("spiky_loss", f"spiky loss {value:.6g} >= {self.spiky_loss_factor} x running max "
                                f"{self.max_loss:.6g} (not fatal)", loss=value)
                return
            if self.rerun_requested or not self.first_iteration_complete:
                return  # Megatron: no validation before the first optimizer step (no checkpoint to fall back to)
            injected = self.injector.maybe_inject(self._rank())
            if injected or nan or spiky:
                self.rerun_requested = True
                self.initial_result = value
                self.failed_check = "injected error" if injected else "NaN/Inf loss" if nan else "spiky loss"
                self.failed_fatal = injected or nan
                self._event("rejected", f"{self.failed_check}: loss {value} rejected on {hardware_id()}; re-running "
                            "the iteration in place", loss=value, check=self.failed_check)
        elif self.state == RERUNNING_IN_PLACE and self.initial_result is not None and self.failed_check:
            diff = self.injector.compare(self.initial_result, value, self.state)
            self.rerun_result = value
            if not self.failed_fatal:
                self.continue_requested = True
                self._event(NOT_FATAL, f"{self.failed_check} re-run in place: {value} vs {self.initial_result} "
                            f"({'same' if diff == 0 else 'different'}); not fatal, continuing", loss=value)
            elif diff > 0:
                self._event(TRANSIENT_FAULT, f"{self.failed_check} is not reproducible ({value} != "
                            f"{self.initial_result}): transient fault; saving and exiting with code "
                            f"{EXIT_CODE_FAILED_ON_RESULT_VALIDATION}", verdict=TRANSIENT_FAULT, loss=value)
            else:
                self.checkpoint_requested = True
                self.suspicious_hardware = hardware_id()
                self._event(REPRODUCIBLE_NEEDS_OTHER_HARDWARE, f"{self.failed_check} is reproducible ({value} == "
                            f"{self.initial_result}) on {self.suspicious_hardware}: saving and exiting with code "
                            f"{EXIT_CODE_RESUME_TO_DISAMBIGUATE}; resume on other hardware to decide",
                            verdict=REPRODUCIBLE_NEEDS_OTHER_HARDWARE, loss=value)
        elif self.state == RERUNNING_FROM_CHECKPOINT and self.initial_result is not None and self.failed_check:
            here = hardware_id()
            if here == self.suspicious_hardware:
                self.restart_again_requested = True
                self._event(SAME_HARDWARE, f"resumed on the same hardware {here}: resume again elsewhere (exit "
                            f"{EXIT_CODE_RESUME_TO_DISAMBIGUATE})", verdict=SAME_HARDWARE)
                return
            diff = self.injector.compare(self.initial_result, value, self.state)
            if diff > 0:
                self._event(PERSISTENT_FAULT, f"{self.failed_check}: {value} on {here} != {self.initial_result} on "
                            f"{self.suspicious_hardware}: persistent fault of {self.suspicious_hardware}; exiting "
                            f"with code {EXIT_CODE_FAILED_ON_RESULT_VALIDATION}", verdict=PERSISTENT_FAULT, loss=value)
            else:
                self._event(CORRECT_RESULT, f"{self.failed_check}: {value} on {here} == {self.initial_result}: "
                            "correct result (possible application error); exiting with code "
                            f"{EXIT_CODE_FAILED_ON_RESULT_VALIDATION}", verdict=CORRECT_RESULT, loss=value)

    def _rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    def _event(self, kind: str, message: str, **fields: Any) -> None:
        self.events.append({"kind": kind, "message": message, "iteration": self.current_iteration, **fields})

    def take_events(self) -> list[dict[str, Any]]:
        events, self.events = self.events, []
        return events

    def take_stats(self) -> Optional[dict[str, float]]:
        """report_stats: the variability since the last call (max over ranks), or None when nothing ran."""
        if self.mode != "report_stats":
            return None
        local = torch.tensor([max(self.stats, default=0.0), sum(self.stats), float(len(self.stats)),
                              float(sum(d > 0 for d in self.stats))], dtype=torch.float64)
        if dist.is_initialized():
            maxes = local[:1].clone()
            sums = local[1:].clone()
            dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
            dist.all_reduce(sums)
            local = torch.cat([maxes, sums])
        self.stats = []
        count = local[2].item()
        if count == 0:
            return None
        return {"max_relative_diff": local[0].item(), "mean_relative_diff": local[1].item() / count,
                "reruns": int(count), "nonzero_diffs": int(local[3].item())}

    # ----------------------------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps, under a per-rank key (pickled: DCP keeps one copy of identical keys): the
        pending diagnosis and the spiky-loss statistics. Empty when the machine is disabled."""
        if not self.enabled:
            return {}
        state = {
            "state": self.state,
            "current_iteration": self.current_iteration,
            "initial_result": self.initial_result,
            "failed_check": self.failed_check,
            "failed_fatal": self.failed_fatal,
            "suspicious_hardware": self.suspicious_hardware,
            "injected": self.injector.injected,
            "injector_rng": self.injector.rng.getstate(),
            "max_loss": self.max_loss,
            "loss_count": self.loss_count,
        }
        return {_rank_key(): pickle.dumps(state)}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Restore a saved machine. The configuration of this run (mode, injection rate/type) stays; a pending
        diagnosis (exit 16) resumes as the re-run from the checkpoint; a transient fault (exit 17) resumes normally."""
        blob = saved.get(_rank_key())
        if blob is None:
            return
        sd = pickle.loads(blob.getvalue() if hasattr(blob, "getvalue") else blob)
        self.max_loss = float(sd.get("max_loss", 0.0))
        self.loss_count = int(sd.get("loss_count", 0))
        if "injector_rng" in sd:
            self.injector.rng.setstate(sd["injector_rng"])
        self.current_iteration = int(sd.get("current_iteration", 0))
        state = sd.get("state", NOT_RUNNING_YET)
        if self.mode == "validate_results" and state in (WILL_RERUN_FROM_CHECKPOINT, RERUNNING_AGAIN_FROM_CHECKPOINT):
            self.state = WILL_RERUN_FROM_CHECKPOINT
            self.current_iteration -= 1  # the iteration runs again
            self.first_iteration_complete = True
            self.initial_result = sd["initial_result"]
            self.failed_check = sd["failed_check"]
            self.failed_fatal = bool(sd["failed_fatal"])
            self.suspicious_hardware = sd["suspicious_hardware"]
            self.injector.injected = sd.get("injected")
            self._reset_flags()
            self._event("resume_to_disambiguate", f"resuming the re-run of the iteration that failed "
                        f"'{self.failed_check}' on {self.suspicious_hardware}; here is {hardware_id()}")
        else:
            self.state = NOT_RUNNING_YET


def _rank_key() -> str:
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    return f"rank{rank}_of{world}"


def local_loss(reports: list[dict[str, Any]]) -> float:
    """This rank's loss of the iteration: Σ(loss·mask)/Σmask of its microbatches' first [sum, count] report."""
    if not reports:
        return 0.0
    for key, value in reports[0].items():
        first = torch.as_tensor(value).detach().view(-1)
        if first.numel() == 2:
            total = torch.stack([torch.as_tensor(r[key]).detach().double().cpu().view(-1) for r in reports]).sum(0)
            return float(total[0] / total[1].clamp(min=1))
    return float(torch.stack([torch.as_tensor(r[next(iter(r))]).detach().double().cpu().view(()) for r in reports]).mean())
