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
    from longspan.training.configs.infra import FaultToleranceConfig

    cfg.ft = FaultToleranceConfig(simulate_fault=True)
    with pytest.raises(ConfigError, match="ft.simulate_fault=True needs ft.enable_ft_package"):
        cfg.validate(world_size=1)
