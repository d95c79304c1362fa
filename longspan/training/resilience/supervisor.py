"""In-process restart, the supervisor side: ``longspan pretrain [--nproc-per-node N]`` with
``inprocess_restart.enabled`` starts its workers through this instead of torch elastic's agent.

The supervisor hosts a TCPStore, starts the N workers (the environment torchrun would give them plus the store's
address and their generation) and watches them every ``monitor_process_interval`` seconds:

- a worker killed by a signal is **dead**; a worker whose heartbeat or progress timestamps are older than
  ``heartbeat_timeout`` / ``hard_timeout`` (or that has written none ``barrier_timeout`` seconds after its start)
  is **hung** and is terminated (SIGTERM, SIGKILL after
  ``termination_grace_time``). After ``last_call_wait`` seconds (concurrent faults are handled together) the
  supervisor moves the job to the next generation and starts one new process per failed rank
  (``granularity='rank'``) or for every rank of the node (``'node'``); the surviving workers restart in place
  (resilience/inprocess.py). ``max_iterations`` bounds the restarts, ``max_rank_faults`` one rank's faults.
- ``active_world_size`` < N: processes beyond it start as warm reserves (imported, connected, waiting); a failed
  active rank's place goes to a live reserve at the next generation (the workload keeps its world size) and the
  failed process is replaced by a new reserve; without a live reserve the failed rank gets a new process.
- a worker without training progress for ``soft_timeout`` seconds is interrupted by its own monitor thread, which
  moves the job to the next generation itself; the supervisor reports that fault and restart (every rank restarts
  in place, no process is replaced) and counts it against the same budgets.
- a worker that exits on its own (0, or an error, the rerun machine's 16/17 included) ends the job: nobody restarts
  any more, the others have ``completion_timeout`` seconds to exit, and the job's exit code is the first nonzero
  worker code (2, 16 and 17 kept; others 1), else 0.

Every fault and restart is a log line, a ``progress.txt`` entry and a ``metrics.jsonl`` record, and a line in
``{monitor_process_logdir}/inprocess_monitor.log`` when that is set.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Optional

from longspan.config.schema.infra import InProcessRestartConfig
from longspan.core.logging import get_logger
from longspan.training.resilience.inprocess import (
    FINISHING_KEY,
    GENERATION_ENV,
    GENERATION_KEY,
    SLOT_ENV,
    STORE_ENV,
    arrived_key,
    assignment_key,
    exiting_key,
    heartbeat_key,
    progress_key,
    soft_timeout_key,
)
from longspan.parallel.launcher import last_log_line

logger = get_logger(__name__)

#: exit codes a worker passes on unchanged (user error, the rerun state machine's two)
KEPT_EXIT_CODES = (2, 16, 17)
MONITOR_LOG = "inprocess_monitor.log"

Reporter = Callable[[str, str, dict], None]


@dataclass
class Fault:
    """One failed rank: how it was found (``rank_died`` / ``rank_hung``) and why."""

    rank: int
    pid: int
    detection: str
    detail: str


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with code {returncode}"


def stale_ranks(now: float, stamps: dict[int, tuple[Optional[float], Optional[float]]], started: dict[int, float],
                ipr: InProcessRestartConfig) -> list[tuple[int, str]]:
    """(rank, why) for each rank whose heartbeat is older than ``heartbeat_timeout`` or progress older than
    ``hard_timeout``. A rank that has written neither yet (a process still starting: imports, connecting to the
    store) is given ``barrier_timeout`` seconds from its start, as long as its peers wait for it at the barrier."""
    out = []
    for rank, (beat, progress) in sorted(stamps.items()):
        if beat is None and progress is None:
            age = now - started[rank]
            if age > ipr.barrier_timeout:
                out.append((rank, f"no heartbeat {age:.1f} s after its start "
                                  f"(inprocess_restart.barrier_timeout={ipr.barrier_timeout:g})"))
            continue
        beat_age = now - (beat if beat is not None else started[rank])
        progress_age = now - (progress if progress is not None else started[rank])
        if progress_age > ipr.hard_timeout:
            out.append((rank, f"no progress for {progress_age:.1f} s "
                              f"(inprocess_restart.hard_timeout={ipr.hard_timeout:g})"))
        elif beat_age > ipr.heartbeat_timeout:
            out.append((rank, f"no heartbeat for {beat_age:.1f} s "
                              f"(inprocess_restart.heartbeat_timeout={ipr.heartbeat_timeout:g})"))
    return out


def ranks_to_restart(faulty: list[int], world_size: int, granularity: str) -> list[int]:
    """The ranks that get new processes: the failed ones ('rank'), or every rank of their node ('node'; this
    supervisor runs one node, so all of them)."""
    return sorted(set(faulty)) if granularity == "rank" else list(range(world_size))


def budget_exceeded(restarts_done: int, rank_faults: Counter, ipr: InProcessRestartConfig) -> Optional[str]:
    """Why the job may not restart again (None: it may)."""
    if ipr.max_iterations is not None and restarts_done >= ipr.max_iterations:
        return f"{restarts_done} restarts done, inprocess_restart.max_iterations={ipr.max_iterations}"
    if ipr.max_rank_faults is not None:
        for rank, count in sorted(rank_faults.items()):
            if count > ipr.max_rank_faults:
                return f"rank {rank} failed {count} times, inprocess_restart.max_rank_faults={ipr.max_rank_faults}"
    return None


def restarts_remaining(restarts_done: int, ipr: InProcessRestartConfig) -> Optional[int]:
    return None if ipr.max_iterations is None else max(0, ipr.max_iterations - restarts_done)


def job_exit_code(codes: list[int]) -> int:
    """The job's code from its workers' exit codes (in exit order)."""
    for code in codes:
        if code != 0:
            return code if code in KEPT_EXIT_CODES else 1
    return 0


def supervisor_reporter(save_dir: Optional[str], metrics_path: Optional[str], world_size: int,
                        log_dir: Optional[str]) -> Reporter:
    """The supervisor's event sink: ``report(kind, message, record)`` -> a log line, a progress.txt entry and a
    metrics.jsonl record (and a monitor log line)."""
    # events imports torch: the supervisor process runs without it (start-up time)
    from longspan.training.resilience.events import append_event_files

    def report(kind: str, message: str, record: dict) -> None:
        line = f"resilience: {kind}: {message}"
        logger.warning(line)
        monitor_log(log_dir, line)
        append_event_files(save_dir, metrics_path, world_size, kind, message, record)

    return report


def monitor_log(log_dir: Optional[str], line: str) -> None:
    if log_dir:
        os.makedirs(log_dir, exist_ok=True)
        with open(os.path.join(log_dir, MONITOR_LOG), "a", encoding="utf-8") as fh:
            fh.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}\n")


class InProcessSupervisor:
    """Starts ``python -m longspan <argv>`` as ranks 0..N-1 of one node and keeps the job alive (module docstring)."""

    def __init__(self, argv: list[str], world_size: int, ipr: InProcessRestartConfig, report: Reporter,
                 extra_env: Optional[dict[str, str]] = None, command: Optional[list[str]] = None) -> None:
        self.argv = argv
        self.world_size = world_size  # processes; the workload runs on the first ``active`` ranks
        self.active = ipr.active_world_size or world_size
        # process slot -> the workload rank it runs (-1: a warm reserve)
        self.rank_of = {slot: (slot if slot < self.active else -1) for slot in range(world_size)}
        self.ipr = ipr
        self.report = report
        self.extra_env = extra_env or {}
        self.command = command or [sys.executable, "-m", "longspan"]
        self.procs: dict[int, subprocess.Popen] = {}
        self.started: dict[int, float] = {}
        self.generation = 0
        self.restarts = 0
        self.rank_faults: Counter = Counter()
        self.exit_codes: list[int] = []
        self.pending_rejoin: Optional[tuple[int, float]] = None  # (generation, when its fault was detected)
        self._signal: Optional[int] = None
        # worker stderr goes to files (N interleaved tracebacks never reach the console); kept when a rank failed
        self.log_dir = tempfile.mkdtemp(prefix="longspan_inprocess_")
        self.stderr_files: dict[int, str] = {}

    # ---- processes -------------------------------------------------------------------------------------
    def _spawn(self, rank: int) -> None:
        """Start the worker process of slot ``rank`` (a reserve learns its rank from the store when it gets one)."""
        env = {**os.environ, **self.extra_env,
               "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(self.active),
               "LOCAL_WORLD_SIZE": str(self.active), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self.store.port), SLOT_ENV: str(rank),
               STORE_ENV: f"127.0.0.1:{self.store.port}", GENERATION_ENV: str(self.generation)}
        for key in (heartbeat_key(rank), progress_key(rank), exiting_key(rank)):
            self.store.delete_key(key)
        path = os.path.join(self.log_dir, f"rank{rank}.gen{self.generation}.stderr")
        with open(path, "w") as stderr:
            self.procs[rank] = subprocess.Popen(self.command + self.argv, env=env, stderr=stderr)
        self.stderr_files[rank] = path
        self.started[rank] = time.time()

    def _terminate(self, ranks: list[int]) -> None:
        """SIGTERM, then SIGKILL after termination_grace_time for those still running."""
        alive = [self.procs[r] for r in ranks if self.procs[r].poll() is None]
        for proc in alive:
            _signal_quietly(proc, signal.SIGCONT)  # a stopped process cannot act on SIGTERM
            _signal_quietly(proc, signal.SIGTERM)
        deadline = time.time() + self.ipr.termination_grace_time
        while time.time() < deadline and any(p.poll() is None for p in alive):
            time.sleep(0.01)
        for proc in alive:
            if proc.poll() is None:
                _signal_quietly(proc, signal.SIGKILL)
            proc.wait()

    def _timestamps(self) -> dict[int, tuple[Optional[float], Optional[float]]]:
        def read(key: str) -> Optional[float]:
            return float(self.store.get(key)) if self.store.check([key]) else None

        return {r: (read(heartbeat_key(r)), read(progress_key(r))) for r, p in self.procs.items()
                if p.poll() is None and r not in self._exiting()}

    def _exiting(self) -> dict[int, int]:
        """rank -> exit code of the ranks that have finished and are shutting down."""
        return {r: int(self.store.get(exiting_key(r))) for r in self.procs if self.store.check([exiting_key(r)])}

    def _returncode(self, rank: int) -> int:
        """The rank's exit code; for one terminated while shutting down, the code it was exiting with."""
        code = self.procs[rank].returncode
        return self._exiting().get(rank, code) if code is not None and code < 0 else code

    # ---- the loop --------------------------------------------------------------------------------------
    def run(self) -> int:
        # torch on first use: the supervisor process runs without torch (start-up time)
        import torch.distributed as dist

        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=self.ipr.barrier_timeout))
        self._publish_ranks(0)
        self.store.set(GENERATION_KEY, "0")
        saved = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            for rank in range(self.world_size):
                self._spawn(rank)
            monitor_log(self.ipr.monitor_process_logdir,
                        f"started {self.world_size} workers: pids {[p.pid for p in self.procs.values()]}")
            code = self._watch()
            if code == 0 and not self.restarts:
                shutil.rmtree(self.log_dir, ignore_errors=True)
            return code
        finally:
            for s, h in saved.items():
                signal.signal(s, h)
            for proc in self.procs.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()

    def _on_signal(self, signum: int, frame: Any) -> None:  # noqa: ARG002 - signal handler signature
        self._signal = signum

    def _publish_ranks(self, generation: int) -> None:
        """Each process slot's workload rank in ``generation`` (written before the generation is)."""
        for slot, rank in self.rank_of.items():
            self.store.set(assignment_key(generation, slot), str(rank))

    def _name(self, slot: int) -> str:
        rank = self.rank_of[slot]
        return f"rank {rank}" if rank >= 0 else f"reserve process {slot}"

    def _promote_reserves(self, failed: list[int]) -> dict[int, int]:
        """Give each failed active slot's rank to a live warm reserve; {rank: the reserve's slot}."""
        promoted = {}
        for slot in failed:
            reserves = [s for s, r in sorted(self.rank_of.items())
                        if r < 0 and s not in failed and self.procs[s].poll() is None]
            if self.rank_of[slot] < 0 or not reserves:
                continue
            promoted[self.rank_of[slot]] = reserves[0]
            self.rank_of[reserves[0]], self.rank_of[slot] = self.rank_of[slot], -1
        return promoted

    def _store_generation(self) -> int:
        return int(self.store.get(GENERATION_KEY))

    def _soft_timeout_faults(self) -> list[Fault]:
        """The ranks whose monitor thread interrupted them for lack of progress (each record read once)."""
        faults = []
        for rank, proc in sorted(self.procs.items()):
            key = soft_timeout_key(rank)
            if self.store.check([key]):
                _, _, stalled = self.store.get(key).decode().partition(":")
                self.store.delete_key(key)
                why = (f"no progress for {float(stalled):.1f} s (inprocess_restart.soft_timeout="
                       f"{self.ipr.soft_timeout:g}); interrupted in place")
                faults.append(Fault(rank, proc.pid, "soft_timeout", why))
        return faults

    def _adopt_worker_restart(self) -> Optional[int]:
        """A worker's soft timeout moved the job to a newer generation: report it as this supervisor's restart."""
        newest = self._store_generation()
        if newest <= self.generation:
            return None
        return self._restart(self._soft_timeout_faults(), in_place_generation=newest)

    def _watch(self) -> int:
        while True:
            if self._signal is not None:
                return self._forward_signal(self._signal)
            failed = self._adopt_worker_restart()
            if failed is not None:
                return failed
            faults, exited = self._poll()
            if exited or len(self._exiting()) == self.world_size:
                return self._finish()
            if faults:
                time.sleep(self.ipr.last_call_wait)  # concurrent faults of other ranks join this restart
                more, exited = self._poll(exclude={f.rank for f in faults})
                faults += more + self._soft_timeout_faults()  # a soft timeout at the same time joins this restart
                if exited:
                    return self._finish()
                failed = self._restart(faults)
                if failed is not None:
                    return failed
            self._check_rejoined()
            time.sleep(self.ipr.monitor_process_interval)

    def _poll(self, exclude: frozenset | set = frozenset()) -> tuple[list[Fault], bool]:
        """Dead and hung ranks (hung ones terminated here), and whether a rank exited on its own."""
        faults, exited = [], False
        exiting = self._exiting()
        for rank, proc in sorted(self.procs.items()):
            code = proc.poll()
            if rank in exclude or code is None:
                continue
            if code < 0 and rank not in exiting:
                faults.append(Fault(rank, proc.pid, "rank_died", f"its process was {describe_exit(code)}"))
            else:
                exited = True
        for rank, why in stale_ranks(time.time(), self._timestamps(), self.started, self.ipr):
            if rank in exclude:
                continue
            self._terminate([rank])
            faults.append(Fault(rank, self.procs[rank].pid, "rank_hung", why + "; terminated"))
        return faults, exited

    def _restart(self, faults: list[Fault], in_place_generation: Optional[int] = None) -> Optional[int]:
        """Move to the next generation with new processes for the failed ranks (none when a worker's soft timeout
        already moved the job to ``in_place_generation``); an exit code when the budget is spent."""
        for fault in faults:
            self.rank_faults[fault.rank] += 1
        remaining_after = restarts_remaining(self.restarts + 1, self.ipr)
        over = budget_exceeded(self.restarts, self.rank_faults, self.ipr)
        for fault in faults:
            self.report("fault", f"{self._name(fault.rank)} (pid {fault.pid}) failed: {fault.detail}; detected by the "
                        f"in-process supervisor ({fault.detection}); "
                        + ("no restart left" if over else f"in-process restarts remaining: "
                           f"{'unlimited' if remaining_after is None else remaining_after}"),
                        {"rank": self.rank_of[fault.rank] if self.rank_of[fault.rank] >= 0 else None,
                         "process": fault.rank, "pid": fault.pid, "detection": fault.detection,
                         "generation": self.generation,
                         "restarts_remaining": None if over else remaining_after})
        if over is not None:
            self.store.set(FINISHING_KEY, "1")
            sys.stderr.write(f"longspan: error: in-process restart gave up: {over}\n")
            monitor_log(self.ipr.monitor_process_logdir, f"gave up: {over}")
            self._terminate(list(self.procs))
            return 1
        if in_place_generation is None and all(self.rank_of[f.rank] < 0 for f in faults):
            return self._replace_reserves(sorted({f.rank for f in faults}))
        promoted: dict[int, int] = {}
        if in_place_generation is None:
            failed = sorted({f.rank for f in faults})
            replace = ranks_to_restart(failed, self.world_size, self.ipr.granularity)
            self._terminate(replace)  # 'node': the node's other ranks go too
            if self.ipr.granularity == "rank":
                promoted = self._promote_reserves(failed)
            else:  # every process is new: the first ``active`` slots run the workload again
                self.rank_of = {slot: (slot if slot < self.active else -1) for slot in self.rank_of}
            # never behind a generation a worker's soft timeout set meanwhile
            self.generation = max(self.generation, self._store_generation()) + 1
            self._publish_ranks(self.generation)
            self.store.set(GENERATION_KEY, str(self.generation))
        else:
            replace, self.generation = [], in_place_generation
        self.restarts += 1
        for slot in replace:
            self._spawn(slot)
        self._report_restart(replace, promoted, remaining_after)
        return None

    def _replace_reserves(self, slots: list[int]) -> Optional[int]:
        """Failed warm reserves get new processes; the workload does not restart."""
        self._terminate(slots)
        for slot in slots:
            self._spawn(slot)
        monitor_log(self.ipr.monitor_process_logdir, f"new warm reserve process(es) {slots} (pids "
                    f"{[self.procs[s].pid for s in slots]}); the workload goes on")
        return None

    def _report_restart(self, replace: list[int], promoted: dict[int, int], remaining_after: Optional[int]) -> None:
        new = sorted(self.rank_of[s] for s in replace if self.rank_of[s] >= 0)
        slot_of = {r: s for s, r in self.rank_of.items() if r >= 0}
        kept = sorted(r for r, s in slot_of.items() if s not in replace and r not in promoted)
        message = (f"generation {self.generation}: new processes for rank(s) {new} (pids "
                   f"{[self.procs[slot_of[r]].pid for r in new]}); ")
        if promoted:
            message += (f"rank(s) {sorted(promoted)} taken by warm reserve process(es) (pids "
                        f"{[self.procs[promoted[r]].pid for r in sorted(promoted)]}); ")
        reserves = [s for s in replace if self.rank_of[s] < 0]
        if reserves:
            message += f"new warm reserve process(es) {reserves}; "
        self.report("restart", message + f"rank(s) {kept} restart in place (pids unchanged: "
                    f"{[self.procs[slot_of[r]].pid for r in kept]}); resuming from the newest checkpoint",
                    {"generation": self.generation, "replaced_ranks": new, "kept_ranks": kept,
                     "reserve_ranks": sorted(promoted), "restarts_remaining": remaining_after})
        self.pending_rejoin = (self.generation, time.time())

    def _check_rejoined(self) -> None:
        """Log once every rank of the new generation has passed its barrier (the restart latency)."""
        if self.pending_rejoin is None:
            return
        generation, since = self.pending_rejoin
        if int(self.store.add(arrived_key(generation), 0)) >= self.active:
            line = (f"in-process restart: all {self.active} ranks rejoined generation {generation} "
                    f"{time.time() - since:.2f} s after the restart began")
            logger.warning(line)
            monitor_log(self.ipr.monitor_process_logdir, line)
            self.pending_rejoin = None

    def _finish(self) -> int:
        """A rank exited on its own: no more restarts; the others get completion_timeout seconds."""
        self.store.set(FINISHING_KEY, "1")
        deadline = time.time() + self.ipr.completion_timeout
        order: list[int] = []
        while True:
            for rank, proc in sorted(self.procs.items()):
                if proc.poll() is not None and rank not in order:
                    order.append(rank)
            if len(order) == self.world_size:
                break
            if time.time() > deadline:
                late = sorted(set(self.procs) - set(order))
                unfinished = sorted(set(late) - set(self._exiting()))
                sys.stderr.write(f"longspan: {'error: ' if unfinished else ''}rank(s) {late} did not exit within "
                                 f"inprocess_restart.completion_timeout={self.ipr.completion_timeout:g} s of the job's "
                                 f"end{f' (unfinished: {unfinished})' if unfinished else ''}; terminating them\n")
                self._terminate(late)
                order += late
                monitor_log(self.ipr.monitor_process_logdir, f"completion timeout: terminated {late}")
                if unfinished:
                    self.exit_codes = [self._returncode(r) for r in order]
                    return job_exit_code(self.exit_codes) or 1
                break
            time.sleep(0.05)
        self.exit_codes = [self._returncode(r) for r in order]
        code = job_exit_code(self.exit_codes)
        for rank in order:
            returncode = self._returncode(rank)
            if returncode != 0 and code not in (16, 17):
                sys.stderr.write(self._failure_line(rank, returncode) + "\n")
                break
        monitor_log(self.ipr.monitor_process_logdir, f"job finished with exit code {code} after {self.restarts} "
                    f"in-process restart(s); worker exit codes {dict(zip(order, self.exit_codes))}")
        return code

    def _failure_line(self, rank: int, returncode: int) -> str:
        """One line for a failed rank: how it ended, the last line of its stderr, where the full log is."""
        line = f"longspan: error: rank {rank} {describe_exit(returncode)}"

        path = self.stderr_files.get(rank)
        last = last_log_line(path)
        if last:
            line += f": {last.removeprefix('longspan: error: ')}"
        return line + (f" (full log: {path})" if path else "")

    def _forward_signal(self, signum: int) -> int:
        self.store.set(FINISHING_KEY, "1")
        for proc in self.procs.values():
            if proc.poll() is None:
                _signal_quietly(proc, signum)
        deadline = time.time() + self.ipr.completion_timeout
        while time.time() < deadline and any(p.poll() is None for p in self.procs.values()):
            time.sleep(0.05)
        self._terminate(list(self.procs))
        if all(p.returncode == 0 for p in self.procs.values()):
            return 0
        return 128 + signum


def _signal_quietly(proc: subprocess.Popen, sig: int) -> None:
    try:
        proc.send_signal(sig)
    except ProcessLookupError:
        pass
