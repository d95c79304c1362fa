"""Fault tolerance (``ft``) without NVIDIA packages: per-rank heartbeats and a launcher-side monitor.

Worker side (``RankHeartbeat``): with ``ft.enable_ft_package`` and a launcher that watches
(``LONGSPAN_FT_HEARTBEAT_DIR`` set), each rank rewrites ``{dir}/rank{R}.json`` atomically at start-up, after
every iteration and around every checkpoint save: its pid, the elastic restart count, the phase (``setup``,
``iteration``, ``checkpoint``; ``failed`` with the error when an uncaught exception ends the process, ``exited``
when it ends otherwise), the iteration and the time. With ``ft.calc_ft_timeouts`` it also publishes
timeouts learned from the iteration and checkpoint times it observed (``TimeoutCalculator``); rank 0 keeps them
in ``{checkpoint.save}/ft_timeouts.json`` with the checkpoints, and a restarted job starts from them.

Launcher side (``HeartbeatMonitor``, a thread in ``longspan pretrain --nproc-per-node``): a rank whose heartbeat
is older than its timeout (the initial timeout until its first iteration, counted from the worker's spawn; the
checkpoint timeout while saving; else the rank timeout) is declared hung and SIGKILLed, also when it was stopped
from outside (SIGSTOP) or hangs before its first heartbeat (in imports or the process-group set-up); a rank whose
process is gone is reported as dead, one that raised as failed. torch elastic then tears the worker group down and restarts it (up to
``--max-restarts``), and training resumes from the newest checkpoint. Each detection is one log line naming the
rank, how it was detected and the restarts remaining, a progress.txt entry and a metrics.jsonl record.

``ft.simulate_fault`` injects a fault in the first run of the job (restart 0): after
``simulated_fault_base_delay`` seconds plus up to one more, rank ``simulated_fault_rank`` (random when None)
stops itself (``rank_hung``, SIGSTOP) or kills itself (``rank_killed``, SIGKILL); ``random`` picks one.
"""

from __future__ import annotations

import atexit
import json
import os
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from longspan.core.errors import ConfigError
from longspan.core.logging import get_logger
from longspan.training.resilience.process_exits import ProcessExits

logger = get_logger(__name__)

HEARTBEAT_DIR_ENV = "LONGSPAN_FT_HEARTBEAT_DIR"
TIMEOUTS_FILENAME = "ft_timeouts.json"
#: learned timeouts are this many times the longest observed interval (nvidia-resiliency-ext's safety factor)
SAFETY_FACTOR = 5.0
#: ... and never below this many seconds
MIN_LEARNED_TIMEOUT = 2.0
#: iterations observed before iteration timeouts are learned
MIN_OBSERVATIONS = 3


def _restart_count() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def _atomic_write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


# The heartbeat an uncaught exception is reported to (the newest: a process that sets up again, as in-process
# restart does, makes a new one), and whether that happened (then no later beat overwrites the failure).
_active_heartbeat: Optional["RankHeartbeat"] = None
_previous_excepthook: Callable[..., Any] = sys.excepthook
_process_failed = False


def _install_excepthook(heartbeat: "RankHeartbeat") -> None:
    global _active_heartbeat, _previous_excepthook
    _active_heartbeat = heartbeat
    if sys.excepthook is not _report_uncaught:
        _previous_excepthook = sys.excepthook
        sys.excepthook = _report_uncaught


def _report_uncaught(exc_type: Any, exc: BaseException, tb: Any) -> None:
    """sys.excepthook: the exception that ends this process goes into a last ``failed`` beat, then the usual
    traceback."""
    global _process_failed
    try:
        beat = _active_heartbeat
        last = json.loads(beat.path.read_text()).get("phase") if beat.path.is_file() else None
        beat.beat("failed", error=f"{exc_type.__name__}: {exc}"[:300], failed_phase=last, exit_code=1)
        _process_failed = True
    except Exception:  # reporting must never hide the real error
        pass
    finally:
        _previous_excepthook(exc_type, exc, tb)


@dataclass
class TimeoutCalculator:
    """Timeouts learned from observed intervals: SAFETY_FACTOR x the longest, at least MIN_LEARNED_TIMEOUT."""

    max_iteration_s: float = 0.0
    max_checkpoint_s: float = 0.0
    iterations_seen: int = 0

    def observe_iteration(self, seconds: float) -> None:
        self.iterations_seen += 1
        self.max_iteration_s = max(self.max_iteration_s, seconds)

    def observe_checkpoint(self, seconds: float) -> None:
        self.max_checkpoint_s = max(self.max_checkpoint_s, seconds)

    def rank_timeout(self) -> Optional[float]:
        if self.iterations_seen < MIN_OBSERVATIONS:
            return None
        return max(MIN_LEARNED_TIMEOUT, SAFETY_FACTOR * self.max_iteration_s)

    def checkpoint_timeout(self) -> Optional[float]:
        if self.max_checkpoint_s <= 0:
            return None
        return max(MIN_LEARNED_TIMEOUT, SAFETY_FACTOR * self.max_checkpoint_s)

    def state(self) -> dict[str, Any]:
        return {"max_iteration_s": self.max_iteration_s, "max_checkpoint_s": self.max_checkpoint_s,
                "iterations_seen": self.iterations_seen, "rank_timeout": self.rank_timeout(),
                "checkpoint_timeout": self.checkpoint_timeout()}

    def merge(self, saved: dict[str, Any]) -> None:
        self.max_iteration_s = max(self.max_iteration_s, float(saved.get("max_iteration_s", 0.0)))
        self.max_checkpoint_s = max(self.max_checkpoint_s, float(saved.get("max_checkpoint_s", 0.0)))
        self.iterations_seen = max(self.iterations_seen, int(saved.get("iterations_seen", 0)))


def beat_before_distributed_init(ft_cfg: Any) -> None:
    """A first ``setup`` heartbeat before the process group forms (rank from the launcher's ``RANK``): ranks
    that wait there for a peer have beaten, a peer hung before (in its imports) has not, and is the one blamed."""
    directory = os.environ.get(HEARTBEAT_DIR_ENV)
    if ft_cfg is None or not ft_cfg.enable_ft_package or not directory or "RANK" not in os.environ:
        return
    rank = int(os.environ["RANK"])
    _atomic_write_json(Path(directory) / f"rank{rank}.json", {"rank": rank, "pid": os.getpid(), "phase": "setup",
                       "restart": _restart_count(), "iteration": 0, "time": time.time()})


class RankHeartbeat:
    """This rank's heartbeat file (a no-op object when fault tolerance is off or nobody watches)."""

    def __init__(self, ft_cfg: Any, save_dir: Optional[str], rank: int, world_size: int) -> None:
        directory = os.environ.get(HEARTBEAT_DIR_ENV)
        self.enabled = bool(ft_cfg is not None and ft_cfg.enable_ft_package and directory)
        self.ft_cfg = ft_cfg
        self.rank = rank
        self.world_size = world_size
        self.save_dir = save_dir
        self.path = Path(directory) / f"rank{rank}.json" if directory else None
        self.restart = _restart_count()
        self.learn = bool(self.enabled and ft_cfg.calc_ft_timeouts)
        self.timeouts = TimeoutCalculator()
        self.last_beat = time.monotonic()
        self.iteration = 0
        if self.enabled:
            atexit.register(self.beat, "exited")  # a normal end: not a fault for the monitor
            _install_excepthook(self)  # an exception: the monitor reports it before torch elastic restarts
        if self.learn and save_dir and (Path(save_dir) / TIMEOUTS_FILENAME).is_file():
            try:
                self.timeouts.merge(json.loads((Path(save_dir) / TIMEOUTS_FILENAME).read_text()))
            except (OSError, ValueError):
                logger.warning(f"ignoring unreadable {Path(save_dir) / TIMEOUTS_FILENAME}")

    def beat(self, phase: str, iteration: Optional[int] = None, **extra: Any) -> None:
        if not self.enabled or _process_failed:  # a failure stays the last word (atexit beats come after it)
            return
        if iteration is not None:
            self.iteration = iteration
        data = {"rank": self.rank, "pid": os.getpid(), "restart": self.restart, "phase": phase,
                "iteration": self.iteration, "time": time.time(), **extra}
        if self.learn:
            data["rank_timeout"] = self.timeouts.rank_timeout()
            data["checkpoint_timeout"] = self.timeouts.checkpoint_timeout()
        _atomic_write_json(self.path, data)

    def iteration_done(self, iteration: int) -> None:
        """After every iteration: beat, and learn from the time since the previous beat."""
        now = time.monotonic()
        if self.learn and self.iteration > 0:  # the first iteration includes start-up costs
            self.timeouts.observe_iteration(now - self.last_beat)
        self.last_beat = now
        self.beat("iteration", iteration)

    def checkpoint_started(self) -> None:
        self._ckpt_start = time.monotonic()
        self.beat("checkpoint")

    def checkpoint_finished(self) -> None:
        if not self.enabled:
            return
        if self.learn:
            self.timeouts.observe_checkpoint(time.monotonic() - self._ckpt_start)
            if self.rank == 0 and self.save_dir and Path(self.save_dir).is_dir():
                _atomic_write_json(Path(self.save_dir) / TIMEOUTS_FILENAME, self.timeouts.state())
        self.last_beat = time.monotonic()
        self.beat("iteration")

    def start_simulated_fault(self, seed: int) -> Optional[threading.Timer]:
        """``ft.simulate_fault``: arm the fault on the chosen rank (first run of the job only)."""
        cfg = self.ft_cfg
        if not (self.enabled and cfg.simulate_fault) or self.restart != 0:
            return None
        rng = random.Random(seed)  # the same draw on every rank
        target = cfg.simulated_fault_rank if cfg.simulated_fault_rank is not None else rng.randrange(self.world_size)
        if target >= self.world_size:
            raise ConfigError(f"ft.simulated_fault_rank={target} is not a rank of this {self.world_size}-rank run")
        kind = cfg.simulated_fault_type if cfg.simulated_fault_type != "random" else rng.choice(["rank_hung", "rank_killed"])
        delay = cfg.simulated_fault_base_delay + rng.random()
        if target != self.rank:
            return None
        sig = signal.SIGSTOP if kind == "rank_hung" else signal.SIGKILL
        logger.warning(f"ft.simulate_fault: rank {self.rank} will simulate {kind} in {delay:.1f} s")
        timer = threading.Timer(delay, os.kill, args=(os.getpid(), sig))
        timer.daemon = True
        timer.start()
        return timer


# --------------------------------------------------------------------------------------------- monitor


def _process_state(pid: int) -> str:
    """'alive', 'stopped', or 'gone' (no process, or a zombie waiting to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except OSError:
            return "gone"
        return "alive"
    if state in ("Z", "X"):
        return "gone"
    return "stopped" if state in ("T", "t") else "alive"


def _process_start_time(pid: int) -> Optional[float]:
    """When process ``pid`` started (epoch seconds), from /proc; None when unknown."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            start_ticks = int(fh.read().rsplit(")", 1)[1].split()[19])  # field 22: start time in clock ticks
        with open("/proc/uptime") as fh:
            uptime = float(fh.read().split()[0])
    except (OSError, IndexError, ValueError):
        return None
    return time.time() - (uptime - start_ticks / os.sysconf("SC_CLK_TCK"))


def _process_env(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            items = fh.read().split(b"\0")
    except OSError:
        return {}
    return dict(item.decode(errors="replace").split("=", 1) for item in items if b"=" in item)


def _child_pids() -> set[int]:
    """This process's children (the workers torch elastic spawned, from any of its threads)."""
    pids: set[int] = set()
    for task in Path("/proc/self/task").glob("*"):
        try:
            pids.update(int(p) for p in (task / "children").read_text().split())
        except (OSError, ValueError):
            continue
    return pids


class HeartbeatMonitor(threading.Thread):
    """Watches the heartbeat files of the local workers; SIGKILLs hung ranks (see the module docstring)."""

    def __init__(
        self,
        directory: str,
        *,
        initial_timeout: float,
        rank_timeout: float,
        max_restarts: int,
        report: Callable[[str, dict[str, Any]], None],
        poll_interval: float = 0.05,
        watch_spawned: bool = False,
    ) -> None:
        super().__init__(name="longspan-ft-monitor", daemon=True)
        self.directory = Path(directory)
        self.initial_timeout = float(initial_timeout)
        self.rank_timeout = float(rank_timeout)
        self.max_restarts = int(max_restarts)
        self.report = report
        self.poll_interval = poll_interval
        # The launcher's own workers (children of this process whose environment names this directory) are
        # timed from their spawn: a hang before the first heartbeat is caught, and the initial timeout counts
        # from the start of the process.
        self.watch_spawned = watch_spawned
        self._spawn_info: dict[int, Optional[dict[str, Any]]] = {}
        self.handled: set[int] = set()  # pids already reported
        self.detections: list[dict[str, Any]] = []
        self.exits = ProcessExits()
        self._stop_event = threading.Event()

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=5)

    def run(self) -> None:
        try:
            while not self._stop_event.is_set():
                self.exits.wait(self.poll_interval)  # wakes at once when a watched worker ends
                if self._stop_event.is_set():
                    break
                try:
                    self.check_once()
                except Exception as exc:  # the monitor must never take the launcher down
                    logger.warning(f"ft monitor: {exc}")
        finally:
            self.exits.close()

    def timeout_for(self, beat: dict[str, Any]) -> float:
        if beat["phase"] in ("setup", "startup"):
            return self.initial_timeout
        if beat["phase"] == "checkpoint":
            learned = beat.get("checkpoint_timeout")
            return max(self.rank_timeout, learned) if learned else self.rank_timeout
        learned = beat.get("rank_timeout")
        return learned if learned else self.rank_timeout

    def _spawned_workers(self, beating: set[int]) -> list[dict[str, Any]]:
        """Start-up pseudo-beats (phase ``startup``, time = spawn) of this launcher's workers without a heartbeat."""
        out = []
        for pid in _child_pids() - beating - self.handled:
            if pid not in self._spawn_info:
                env = _process_env(pid)
                start = _process_start_time(pid)
                mine = env.get(HEARTBEAT_DIR_ENV) == str(self.directory) and "RANK" in env and start is not None
                self._spawn_info[pid] = {"rank": int(env["RANK"]), "pid": pid, "phase": "startup", "iteration": 0,
                                         "restart": int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
                                         "time": start} if mine else None
            if self._spawn_info[pid] is not None:
                out.append(self._spawn_info[pid])
        return out

    def _started_at(self, beat: dict[str, Any]) -> float:
        """The time a rank's silence counts from: its beat, or (start-up, when watching) its spawn."""
        if self.watch_spawned and beat["phase"] == "setup":
            start = _process_start_time(int(beat["pid"]))
            if start is not None:
                return min(start, float(beat["time"]))
        return float(beat["time"])

    def check_once(self) -> None:
        """One look at every rank; at most one detection per worker-group generation (the root cause: the
        rest of the group is torn down by torch elastic, so its other ranks stop beating or die next)."""
        now = time.time()
        beats = []
        beating: set[int] = set()
        for path in sorted(self.directory.glob("rank*.json")):
            try:
                beat = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            beating.add(int(beat["pid"]))
            if int(beat["pid"]) not in self.handled and beat["phase"] != "exited":  # exited: ended on its own
                beats.append((beat, _process_state(int(beat["pid"]))))
        if self.watch_spawned:
            beats += [(b, _process_state(b["pid"])) for b in self._spawned_workers(beating)]
        for beat, _ in beats:
            self.exits.watch(int(beat["pid"]))
        self.exits.wait(0)  # ends since the last look, each with the time it was first seen
        beats.sort(key=self._blame_order)
        # A rank of a generation with a stopped rank, or one that never beat, is silent because it waits for that
        # rank: not blamed.
        held_up = {int(b["restart"]) for b, state in beats if state == "stopped" or b["phase"] == "startup"}
        for beat, state in beats:
            pid = int(beat["pid"])
            if pid in self.handled:
                continue
            remaining = max(self.max_restarts - int(beat["restart"]), 0)
            where = f"iteration {beat['iteration']}, phase {beat.get('failed_phase') or beat['phase']}"
            if beat["phase"] == "failed":
                self.handled.add(pid)
                self._detected("rank_failed", beat, f"rank {beat['rank']} (pid {pid}) failed at {where}: raised "
                               f"{beat.get('error')}; exit code {beat.get('exit_code', 1)}; torch elastic restarts "
                               f"the worker group; restarts remaining: {remaining}", remaining,
                               error=beat.get("error"), exit_code=beat.get("exit_code", 1))
                continue
            if state == "gone":
                self.handled.add(pid)
                if beat["phase"] != "startup":  # a worker that never beat and is gone: torch elastic reports it
                    self._detected("rank_died", beat, f"rank {beat['rank']} (pid {pid}) died at {where}: detected "
                                   f"by the launcher (process gone); restarts remaining: {remaining}", remaining)
                continue
            if state == "alive" and beat["phase"] != "startup" and int(beat["restart"]) in held_up:
                continue
            age = now - self._started_at(beat)
            timeout = self.timeout_for(beat)
            if age > timeout:
                self.handled.add(pid)
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
                how = "stopped (SIGSTOP) and silent" if state == "stopped" else "silent"
                if beat["phase"] == "startup":
                    how += " since its spawn, before its first heartbeat"
                initial = "initial " if beat["phase"] in ("setup", "startup") else ""
                self._detected("rank_hung", beat, f"rank {beat['rank']} (pid {pid}) hung at {where}: {how} for "
                               f"{age:.1f} s > {initial}heartbeat timeout {timeout:.1f} s, detected by the heartbeat "
                               f"monitor; killed (SIGKILL); restarts remaining: {remaining}", remaining,
                               timeout=timeout, silent_s=round(age, 3))

    def _blame_order(self, item: tuple[dict[str, Any], str]) -> tuple[int, float]:
        """Killed from outside (the first to end first), raised, stopped, never beat, the longest silent; last a
        rank that ended on SIGTERM: torch elastic's stop of the rest of a failed group, not a root cause."""
        beat, state = item
        if state == "gone":
            end = self.exits.ended.get(int(beat["pid"]))
            if end is None:
                return 0, float(beat["time"])
            return (6 if end.signal == signal.SIGTERM else 0), end.seen_at
        if beat["phase"] == "failed":
            return 1, float(beat["time"])
        if state == "stopped":
            return 2, float(beat["time"])
        return (3 if beat["phase"] == "startup" else 4), float(beat["time"])

    def _detected(self, kind: str, beat: dict[str, Any], message: str, remaining: int, **extra: Any) -> None:
        record = {"rank": beat["rank"], "pid": beat["pid"], "restart": beat["restart"], "iteration": beat["iteration"],
                  "rank_phase": beat["phase"], "restarts_remaining": remaining, "detection": kind, **extra}
        self.detections.append(record)
        for path in self.directory.glob("rank*.json"):  # the rest of this generation goes down with it
            try:
                other = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if other["restart"] == beat["restart"]:
                self.handled.add(int(other["pid"]))
        for pid, info in self._spawn_info.items():
            if info is not None and info["restart"] == beat["restart"]:
                self.handled.add(pid)
        self.report(message, record)


def monitor_reporter(save_dir: Optional[str], metrics_path: Optional[str], world_size: int) -> Callable[[str, dict], None]:
    """The launcher's event sink: a log line, a progress.txt entry and a metrics.jsonl record per detection."""
    # events imports torch: the launcher's heartbeat monitor runs without it (start-up time)
    from longspan.training.resilience.events import append_event_files

    def report(message: str, record: dict[str, Any]) -> None:
        logger.warning(f"resilience: fault: {message}")
        append_event_files(save_dir, metrics_path, world_size, "fault", message, record)

    return report
