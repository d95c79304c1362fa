"""Acceptance soak test of fault tolerance (issue 12): a 2-rank ``longspan pretrain --max-restarts`` run survives,
one after another, a SIGKILLed rank, a SIGSTOPped rank (found by the heartbeat monitor within its timeout) and a
SIGKILL during a checkpoint save; it finishes every iteration and each iteration's loss equals an uninterrupted
2-rank run's, bit for bit (CPU, dropout on). (A SIGKILL during an asynchronous save is not covered: see
docs/resilience.md.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from longspan.training.configs.infra import FaultToleranceConfig
from longspan.training.resilience.heartbeat import HEARTBEAT_DIR_ENV
from tests.resilience.helpers import ENV, LONGSPAN, metrics_records, resilience_config, run, write_yaml
from tests.training.pretrain_helpers import losses_by_iteration

pytestmark = pytest.mark.slow

ITERS = 24
RANK_TIMEOUT = 8.0


def _beats(hb: Path) -> dict[int, dict[str, Any]]:
    out = {}
    for path in hb.glob("rank*.json"):
        try:
            beat = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        out[beat["rank"]] = beat
    return out


def _wait_for(proc: subprocess.Popen, what: str, condition: Callable[[], Any], timeout: float = 90.0,
              poll: float = 0.002) -> Any:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (exit {proc.returncode}) while waiting for {what}")
        found = condition()
        if found:
            return found
        time.sleep(poll)
    raise AssertionError(f"timed out waiting for {what}")


def _beat_at(hb: Path, rank: int, restart: int, min_iteration: int) -> Callable[[], Any]:
    """Rank ``rank`` of a worker generation >= ``restart`` has finished iteration ``min_iteration``."""
    def check() -> Any:
        beat = _beats(hb).get(rank)
        ok = beat and beat["restart"] >= restart and beat["phase"] == "iteration" and beat["iteration"] >= min_iteration
        return beat if ok else None

    return check


def _saving(hb: Path, save: Path, rank: int, restart: int) -> Callable[[], Any]:
    """A checkpoint is being written (its ``.partial`` directory exists) by the worker generation ``restart``."""
    def check() -> Any:
        beat = _beats(hb).get(rank)
        if not beat or beat["restart"] < restart or beat["iteration"] < 1:
            return None
        return beat if any(save.glob("iter_*.partial")) else None

    return check


def _soak_config(tmp_path: Path, name: str, async_save: bool) -> Any:
    cfg = resilience_config(tmp_path, name, ITERS)
    cfg.checkpoint.save_interval = 2
    cfg.checkpoint.async_save = async_save
    if name != "ref":
        cfg.ft = FaultToleranceConfig(enable_ft_package=True)
    return cfg


def _start(cfg: Any, yaml: Path, hb: Path, max_restarts: int) -> subprocess.Popen:
    hb.mkdir()
    env = {**ENV, HEARTBEAT_DIR_ENV: str(hb)}
    args = ["pretrain", "--config", str(yaml), "--nproc-per-node", "2", "--max-restarts", str(max_restarts),
            "--ft-initial-rank-heartbeat-timeout", "120", "--ft-rank-heartbeat-timeout", str(RANK_TIMEOUT)]
    log = open(hb.parent / f"{hb.name}.log", "w")  # a file, not a pipe: nobody reads while the run goes on
    return subprocess.Popen(LONGSPAN + args, env=env, stdout=log, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # its own process group: a failed test kills all workers


def _finish(proc: subprocess.Popen, hb: Path) -> str:
    try:
        proc.wait(timeout=180)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher and any worker left behind
        except ProcessLookupError:
            pass
        proc.wait()
    return (hb.parent / f"{hb.name}.log").read_text()


def _faults(cfg: Any) -> list[dict[str, Any]]:
    return [r for r in metrics_records(cfg) if r.get("phase") == "resilience" and r.get("event") == "fault"]


def test_two_rank_run_survives_kill_hang_and_kill_during_save(tmp_path: Path) -> None:
    ref = _soak_config(tmp_path, "ref", async_save=False)
    result = run(["pretrain", "--config", str(write_yaml(ref, tmp_path / "ref.yaml")), "--nproc-per-node", "2"])
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    reference = losses_by_iteration(ref)
    assert sorted(reference) == list(range(1, ITERS + 1))

    injected = []
    cfg = _soak_config(tmp_path, "soak", async_save=False)
    save = Path(cfg.checkpoint.save)
    hb = tmp_path / "hb"
    proc = _start(cfg, write_yaml(cfg, tmp_path / "soak.yaml"), hb, max_restarts=6)
    try:
        beat = _wait_for(proc, "rank 1 at iteration 3", _beat_at(hb, 1, 0, 3))
        os.kill(beat["pid"], signal.SIGKILL)
        injected.append(("SIGKILL rank 1", beat["iteration"]))

        beat = _wait_for(proc, "restart 1 past its resume point", _beat_at(hb, 0, beat["restart"] + 1, beat["iteration"] + 2))
        os.kill(beat["pid"], signal.SIGSTOP)
        stopped_at = time.time()
        injected.append(("SIGSTOP rank 0", beat["iteration"]))
        _wait_for(proc, "the stopped rank to be killed", lambda: any(f["detection"] == "rank_hung" for f in _faults(cfg)),
                  timeout=RANK_TIMEOUT + 10, poll=0.05)
        detected_after = time.time() - stopped_at

        beat = _wait_for(proc, "a checkpoint save after the restart", _saving(hb, save, 1, beat["restart"] + 1))
        os.kill(beat["pid"], signal.SIGKILL)
        injected.append(("SIGKILL rank 1 during a checkpoint save", beat["iteration"]))
    finally:
        out = _finish(proc, hb)
    assert proc.returncode == 0, out[-4000:]

    faults = _faults(cfg)
    assert [(f["rank"], f["detection"]) for f in faults] == [(1, "rank_died"), (0, "rank_hung"), (1, "rank_died")]
    remaining = [f["restarts_remaining"] for f in faults]
    assert remaining[0] == 6 and remaining == sorted(remaining, reverse=True) and len(set(remaining)) == 3
    assert "stopped (SIGSTOP)" in faults[1]["message"]
    assert RANK_TIMEOUT < detected_after < RANK_TIMEOUT + 5
    progress = (save / "progress.txt").read_text()
    assert progress.count("Resilience event\tfault") == 3

    losses = losses_by_iteration(cfg)
    assert sorted(losses) == list(range(1, ITERS + 1))
    assert losses == reference  # bit-exact across restarts, dropout on
    logged = sum(1 for r in metrics_records(cfg) if r.get("phase", "train") == "train" and "losses" in r)
    lost = logged - ITERS
    print(f"\nfault soak: {len(injected)} faults injected, {len(injected)} survived, {lost} iterations re-run "
          f"(lost); hang detected after {detected_after:.1f} s (timeout {RANK_TIMEOUT} s): {injected}")


def test_simulated_hang_is_detected_and_survived(tmp_path: Path) -> None:
    """ft.simulate_fault: rank 1 stops itself (rank_hung) in the first run; the monitor kills it, the group restarts
    from the last checkpoint (no fault in the restarted run) and the run finishes."""
    cfg = resilience_config(tmp_path, "sim", 60)
    cfg.checkpoint.save_interval = 5
    cfg.ft = FaultToleranceConfig(enable_ft_package=True, simulate_fault=True, simulated_fault_type="rank_hung",
                                  simulated_fault_rank=1, simulated_fault_base_delay=2)
    hb = tmp_path / "hb"
    proc = _start(cfg, write_yaml(cfg, tmp_path / "sim.yaml"), hb, max_restarts=2)
    out = _finish(proc, hb)
    assert proc.returncode == 0, out[-4000:]
    faults = _faults(cfg)
    assert len(faults) == 1 and faults[0]["rank"] == 1 and faults[0]["detection"] == "rank_hung"
    assert "stopped (SIGSTOP)" in faults[0]["message"]
    assert sorted(losses_by_iteration(cfg)) == list(range(1, 61))
