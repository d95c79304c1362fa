"""Fault tolerance pieces without training: the monitor kills a stopped or silent rank and reports a dead one
(one detection per worker generation); learned timeouts; heartbeat files."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from longspan.core.errors import ConfigError, LaunchError
from longspan.training.resilience.heartbeat import (
    HEARTBEAT_DIR_ENV,
    HeartbeatMonitor,
    RankHeartbeat,
    TimeoutCalculator,
    beat_before_distributed_init,
)
from longspan.training.resilience.launch import fault_tolerance_monitor
from tests.resilience.helpers import resilience_config


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def _write_beat(directory: Path, rank: int, pid: int, phase: str, age: float, restart: int = 0, **extra) -> None:
    data = {"rank": rank, "pid": pid, "restart": restart, "phase": phase, "iteration": 5, "time": time.time() - age}
    (directory / f"rank{rank}.json").write_text(json.dumps({**data, **extra}))


def _monitor(tmp_path: Path, **kw) -> tuple[HeartbeatMonitor, list]:
    reports: list = []
    monitor = HeartbeatMonitor(str(tmp_path), initial_timeout=kw.pop("initial", 30.0), rank_timeout=kw.pop("rank", 2.0),
                               max_restarts=3, report=lambda msg, rec: reports.append((msg, rec)))
    return monitor, reports


def test_stopped_rank_is_killed_once_and_blamed(tmp_path: Path) -> None:
    stopped, blocked = _sleeper(), _sleeper()
    try:
        os.kill(stopped.pid, signal.SIGSTOP)
        time.sleep(0.2)  # the signal takes effect when the process is next scheduled
        _write_beat(tmp_path, 0, blocked.pid, "iteration", age=3.0)  # silent too: blocked in a collective
        _write_beat(tmp_path, 1, stopped.pid, "iteration", age=2.5)
        monitor, reports = _monitor(tmp_path)
        monitor.check_once()
        assert stopped.wait(timeout=5) == -signal.SIGKILL
        assert blocked.poll() is None  # the rest of the group is torn down by torch elastic, not blamed
        assert len(reports) == 1
        message, record = reports[0]
        assert record["rank"] == 1 and record["detection"] == "rank_hung" and record["restarts_remaining"] == 3
        assert "stopped (SIGSTOP)" in message and "restarts remaining: 3" in message
        monitor.check_once()
        assert len(reports) == 1
    finally:
        for p in (stopped, blocked):
            p.kill()
            p.wait()


def test_rank_waiting_for_a_stopped_peer_is_not_blamed_even_when_silent_longer(tmp_path: Path) -> None:
    stopped, waiting = _sleeper(), _sleeper()
    try:
        os.kill(stopped.pid, signal.SIGSTOP)
        time.sleep(0.2)
        _write_beat(tmp_path, 0, stopped.pid, "checkpoint", age=1.5)  # its last beat came after the peer's
        _write_beat(tmp_path, 1, waiting.pid, "iteration", age=2.5)  # silent past the timeout: waits for rank 0
        monitor, reports = _monitor(tmp_path)
        monitor.check_once()
        assert reports == [] and waiting.poll() is None
        _write_beat(tmp_path, 0, stopped.pid, "checkpoint", age=2.1)
        monitor.check_once()
        assert stopped.wait(timeout=5) == -signal.SIGKILL and waiting.poll() is None
        assert [(r["rank"], r["detection"]) for _, r in reports] == [(0, "rank_hung")]
    finally:
        for p in (stopped, waiting):
            p.kill()
            p.wait()


def test_fresh_ranks_and_initial_timeout_are_left_alone(tmp_path: Path) -> None:
    alive = _sleeper()
    try:
        _write_beat(tmp_path, 0, alive.pid, "setup", age=10.0)  # starting up: the initial timeout (30 s) applies
        _write_beat(tmp_path, 1, alive.pid + 0, "iteration", age=0.5)
        monitor, reports = _monitor(tmp_path)
        monitor.check_once()
        assert reports == [] and alive.poll() is None
        _write_beat(tmp_path, 0, alive.pid, "setup", age=31.0)
        monitor.check_once()
        assert alive.wait(timeout=5) == -signal.SIGKILL
        assert "initial heartbeat timeout" in reports[0][0]
    finally:
        alive.kill()
        alive.wait()


def test_dead_rank_is_reported_with_restarts_remaining(tmp_path: Path) -> None:
    dead = _sleeper()
    dead.kill()
    dead.wait()
    _write_beat(tmp_path, 1, dead.pid, "checkpoint", age=0.1, restart=2)
    monitor, reports = _monitor(tmp_path)
    monitor.check_once()
    message, record = reports[0]
    assert record["detection"] == "rank_died" and record["restarts_remaining"] == 1
    assert "rank 1" in message and "phase checkpoint" in message


def test_rank_that_raises_is_reported_as_failed(tmp_path: Path) -> None:
    """An uncaught exception ends a worker with a last ``failed`` beat (the atexit beat does not overwrite it);
    the monitor reports the rank, its error, exit code 1 and the restarts remaining."""
    worker = ("from types import SimpleNamespace\n"
              "from longspan.training.resilience.heartbeat import RankHeartbeat\n"
              "ft = SimpleNamespace(enable_ft_package=True, calc_ft_timeouts=False, simulate_fault=False)\n"
              "beat = RankHeartbeat(ft, None, rank=1, world_size=2)\n"
              "beat.iteration_done(4)\n"
              "raise ValueError('boom in iteration 5')\n")
    env = {**os.environ, HEARTBEAT_DIR_ENV: str(tmp_path), "TORCHELASTIC_RESTART_COUNT": "1"}
    result = subprocess.run([sys.executable, "-c", worker], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "ValueError: boom in iteration 5" in result.stderr  # the traceback still shows
    beat = json.loads((tmp_path / "rank1.json").read_text())
    assert beat["phase"] == "failed" and beat["failed_phase"] == "iteration" and beat["iteration"] == 4
    monitor, reports = _monitor(tmp_path)
    monitor.check_once()
    message, record = reports[0]
    assert record["detection"] == "rank_failed" and record["rank"] == 1 and record["restarts_remaining"] == 2
    assert record["exit_code"] == 1 and record["error"] == "ValueError: boom in iteration 5"
    assert "raised ValueError: boom in iteration 5; exit code 1" in message and "restarts remaining: 2" in message
    monitor.check_once()
    assert len(reports) == 1


def test_killed_peer_is_blamed_rather_than_the_rank_that_raised_after_it(tmp_path: Path) -> None:
    dead, survivor = _sleeper(), _sleeper()
    try:
        dead.kill()
        dead.wait()
        _write_beat(tmp_path, 0, survivor.pid, "failed", age=0.1, error="RuntimeError: Connection closed by peer")
        _write_beat(tmp_path, 1, dead.pid, "iteration", age=0.5)
        monitor, reports = _monitor(tmp_path)
        monitor.check_once()
        assert [(r["rank"], r["detection"]) for _, r in reports] == [(1, "rank_died")]
    finally:
        survivor.kill()
        survivor.wait()


def _wait_gone(proc: subprocess.Popen) -> None:
    """Until ``proc`` has ended (a zombie: not reaped, as torch elastic has not collected it yet)."""
    deadline = time.time() + 10
    while time.time() < deadline:
        with open(f"/proc/{proc.pid}/stat") as fh:
            if fh.read().rsplit(")", 1)[1].split()[0] == "Z":
                return
        time.sleep(0.01)
    raise AssertionError(f"process {proc.pid} did not end")


@pytest.mark.parametrize("seen", ["one_at_a_time", "both_in_one_look"])
def test_rank_killed_from_outside_is_blamed_not_the_peer_the_launcher_stopped_after_it(tmp_path: Path,
                                                                                      seen: str) -> None:
    """Rank 1 is SIGKILLed inside a checkpoint save; torch elastic then stops rank 0 (SIGTERM), whose last beat is
    older (it waited for its own async save). Both are gone when the monitor looks: the order of the ends (seen
    through pidfds as they happen) or, when both ended between two looks, the SIGTERM names rank 1."""
    killed, stopped = _sleeper(), _sleeper()
    try:
        _write_beat(tmp_path, 0, stopped.pid, "checkpoint", age=1.0)
        _write_beat(tmp_path, 1, killed.pid, "checkpoint", age=0.2)
        monitor, reports = _monitor(tmp_path)
        monitor.check_once()  # starts watching both
        assert reports == []
        killed.kill()
        if seen == "one_at_a_time":
            monitor.exits.wait(5.0)  # the monitor thread wakes at the kill
            assert list(monitor.exits.ended) == [killed.pid]
        _wait_gone(killed)
        stopped.terminate()
        _wait_gone(stopped)
        monitor.check_once()
        assert [(r["rank"], r["detection"]) for _, r in reports] == [(1, "rank_died")]
        assert monitor.exits.ended[stopped.pid].signal == signal.SIGTERM
    finally:
        for p in (killed, stopped):
            p.kill()
            p.wait()


def test_the_order_of_ends_survives_their_reaping_before_the_monitor_looks(tmp_path: Path) -> None:
    """On a busy machine the monitor thread may run only after torch elastic has reaped the killed rank and
    stopped (and reaped) the other: then neither end shows its signal, and the two look alike. The launcher's
    SIGCHLD handler collects each end as it happens; rank 1, killed first, is blamed. Without that collection
    both ends would be seen in one look and rank 0 (first in file order) blamed."""
    killed, stopped = _sleeper(), _sleeper()
    try:
        _write_beat(tmp_path, 0, stopped.pid, "iteration", age=0.5)
        _write_beat(tmp_path, 1, killed.pid, "iteration", age=0.5)
        monitor, reports = _monitor(tmp_path)
        monitor.check_once()  # starts watching both
        killed.kill()
        _wait_gone(killed)
        monitor.exits.collect()  # the SIGCHLD handler, before torch elastic's loop reaps the child
        killed.wait()  # reaped
        time.sleep(0.01)
        stopped.terminate()
        _wait_gone(stopped)
        monitor.exits.collect()
        stopped.wait()
        monitor.check_once()
        assert [(r["rank"], r["detection"]) for _, r in reports] == [(1, "rank_died")]
        ended = monitor.exits.ended
        assert ended[killed.pid].signal == signal.SIGKILL and ended[killed.pid].seen_at < ended[stopped.pid].seen_at
    finally:
        for p in (killed, stopped):
            p.kill()
            p.wait()


def test_the_launcher_collects_a_child_end_when_it_happens(tmp_path: Path) -> None:
    """Inside ``fault_tolerance_monitor`` a SIGCHLD handler calls the monitor's ``collect`` in the main thread (where
    torch elastic's agent runs) when a child ends; the previous handler comes back afterwards."""
    import threading

    from longspan.config.schema.infra import FaultToleranceConfig
    from longspan.training.resilience import launch

    cfg = resilience_config(tmp_path, "ft", 2)
    cfg.ft = FaultToleranceConfig(enable_ft_package=True)
    args = SimpleNamespace(max_restarts=0, ft_initial_rank_heartbeat_timeout=None, ft_rank_heartbeat_timeout=None)
    before = signal.getsignal(signal.SIGCHLD)
    calls: list[str] = []
    real = launch.HeartbeatMonitor

    class Recording(real):  # the context's monitor, whose collect notes the thread it runs in
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.exits.collect = lambda: calls.append(threading.current_thread().name)

    launch.HeartbeatMonitor = Recording
    try:
        with fault_tolerance_monitor(cfg, args, world_size=1):
            child = _sleeper()
            child.kill()
            deadline = time.time() + 5
            while not calls and time.time() < deadline:
                time.sleep(0.05)  # the handler runs in this thread, while it sleeps
            child.wait()
    finally:
        launch.HeartbeatMonitor = real
    assert calls and set(calls) == {threading.main_thread().name}
    assert signal.getsignal(signal.SIGCHLD) == before


def _spawn_worker(hb: Path, rank: int, restart: int) -> subprocess.Popen:
    env = {**os.environ, HEARTBEAT_DIR_ENV: str(hb), "RANK": str(rank), "TORCHELASTIC_RESTART_COUNT": str(restart)}
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)


def test_worker_hung_before_its_first_heartbeat_is_killed_after_the_initial_timeout(tmp_path: Path) -> None:
    """A worker of this launcher (a child process whose environment names the heartbeat directory) that never
    beats, e.g. hung in its imports or the process-group set-up, is timed from its spawn."""
    hung, other = _spawn_worker(tmp_path, rank=1, restart=2), _sleeper()  # other: not one of the launcher's workers
    try:
        monitor = HeartbeatMonitor(str(tmp_path), initial_timeout=1.5, rank_timeout=1.0, max_restarts=3,
                                   report=lambda msg, rec: reports.append((msg, rec)), watch_spawned=True)
        reports: list = []
        monitor.check_once()
        assert reports == [] and hung.poll() is None
        time.sleep(1.7)
        monitor.check_once()
        assert hung.wait(timeout=5) == -signal.SIGKILL and other.poll() is None
        message, record = reports[0]
        assert record["rank"] == 1 and record["detection"] == "rank_hung" and record["rank_phase"] == "startup"
        assert record["restarts_remaining"] == 1
        assert "before its first heartbeat" in message and "initial heartbeat timeout 1.5 s" in message
    finally:
        for p in (hung, other):
            p.kill()
            p.wait()


def test_rank_that_never_beat_is_blamed_not_the_peers_waiting_for_it(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 reached its set-up (the beat before the process group forms) and waits there for rank 1, hung in its
    imports: rank 1 is killed, although rank 0 was spawned first."""
    waiting = _spawn_worker(tmp_path, rank=0, restart=0)
    time.sleep(1.0)
    hung = _spawn_worker(tmp_path, rank=1, restart=0)
    try:
        monkeypatch.setenv(HEARTBEAT_DIR_ENV, str(tmp_path))
        monkeypatch.setenv("RANK", "0")
        beat_before_distributed_init(SimpleNamespace(enable_ft_package=True))
        beat = json.loads((tmp_path / "rank0.json").read_text())
        assert beat["phase"] == "setup" and beat["rank"] == 0 and beat["pid"] == os.getpid()
        _write_beat(tmp_path, 0, waiting.pid, "setup", age=0.0)  # as the worker would have written it
        reports: list = []
        monitor = HeartbeatMonitor(str(tmp_path), initial_timeout=1.5, rank_timeout=100.0, max_restarts=3,
                                   report=lambda msg, rec: reports.append((msg, rec)), watch_spawned=True)
        time.sleep(1.0)  # rank 0 is past the initial timeout since its spawn (2 s), rank 1 not yet (1 s)
        monitor.check_once()
        assert reports == [] and waiting.poll() is None
        time.sleep(0.7)
        monitor.check_once()
        assert hung.wait(timeout=5) == -signal.SIGKILL and waiting.poll() is None
        assert [(r["rank"], r["rank_phase"]) for _, r in reports] == [(1, "startup")]
    finally:
        for p in (waiting, hung):
            p.kill()
            p.wait()


def test_initial_timeout_counts_from_the_spawn(tmp_path: Path) -> None:
    late = _spawn_worker(tmp_path, rank=0, restart=0)
    try:
        time.sleep(1.2)
        _write_beat(tmp_path, 0, late.pid, "setup", age=0.0)  # its first beat, just now, 1.2 s after its spawn
        reports: list = []
        monitor = HeartbeatMonitor(str(tmp_path), initial_timeout=1.0, rank_timeout=100.0, max_restarts=3,
                                   report=lambda msg, rec: reports.append((msg, rec)), watch_spawned=True)
        monitor.check_once()
        assert late.wait(timeout=5) == -signal.SIGKILL
        assert reports[0][1]["rank_phase"] == "setup" and reports[0][1]["silent_s"] > 1.0
    finally:
        late.kill()
        late.wait()


def test_learned_timeouts_are_used_and_kept_with_checkpoints(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calc = TimeoutCalculator()
    for seconds in (0.1, 0.3, 0.2):
        calc.observe_iteration(seconds)
    assert calc.rank_timeout() == 2.0  # 5 x 0.3 s, at least 2 s
    calc.observe_iteration(1.0)
    assert calc.rank_timeout() == 5.0
    calc.observe_checkpoint(2.0)
    assert calc.checkpoint_timeout() == 10.0

    monitor, _ = _monitor(tmp_path, rank=100.0)
    assert monitor.timeout_for({"phase": "iteration", "rank_timeout": 5.0}) == 5.0
    assert monitor.timeout_for({"phase": "checkpoint", "checkpoint_timeout": 300.0}) == 300.0
    assert monitor.timeout_for({"phase": "iteration"}) == 100.0

    monkeypatch.setenv(HEARTBEAT_DIR_ENV, str(tmp_path / "hb"))
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # RankHeartbeat installs its own: restored after
    (tmp_path / "hb").mkdir()
    save = tmp_path / "ckpt"
    save.mkdir()
    ft = SimpleNamespace(enable_ft_package=True, calc_ft_timeouts=True, simulate_fault=False)
    beat = RankHeartbeat(ft, str(save), rank=0, world_size=1)
    beat.beat("setup")
    for i in range(1, 6):
        beat.iteration_done(i)
    beat.checkpoint_started()
    beat.checkpoint_finished()
    kept = json.loads((save / "ft_timeouts.json").read_text())
    assert kept["iterations_seen"] == 4 and kept["rank_timeout"] == 2.0
    written = json.loads((tmp_path / "hb" / "rank0.json").read_text())
    assert written["rank_timeout"] == 2.0 and written["pid"] == os.getpid()
    restarted = RankHeartbeat(ft, str(save), rank=0, world_size=1)  # a restarted job starts from them
    assert restarted.timeouts.rank_timeout() == 2.0


def test_launch_flags_and_ft_fields_are_checked(tmp_path: Path) -> None:
    cfg = resilience_config(tmp_path, "ft", 2)
    args = SimpleNamespace(max_restarts=-1, ft_initial_rank_heartbeat_timeout=None, ft_rank_heartbeat_timeout=None)
    with pytest.raises(LaunchError, match="--max-restarts=-1"):
        with fault_tolerance_monitor(cfg, args, 2):
            pass
    args = SimpleNamespace(max_restarts=1, ft_initial_rank_heartbeat_timeout=None, ft_rank_heartbeat_timeout=0)
    with pytest.raises(LaunchError, match="--ft-rank-heartbeat-timeout=0"):
        with fault_tolerance_monitor(cfg, args, 2):
            pass
    from longspan.config.schema.infra import FaultToleranceConfig

    cfg.ft = FaultToleranceConfig(simulate_fault=True)
    with pytest.raises(ConfigError, match="ft.simulate_fault=True needs ft.enable_ft_package"):
        cfg.validate(world_size=1)
