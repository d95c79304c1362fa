"""Acceptance soak test of fault tolerance: a 2-rank ``longspan pretrain --max-restarts`` run with
asynchronous checkpoint saves survives, one after another, a SIGKILLed rank, a SIGSTOPped rank (found by the
heartbeat monitor within its timeout), a SIGKILL during a checkpoint save (the rank inside its save call) and a
SIGKILL during an asynchronous save (training has moved on while the background writer is still writing the
``.partial`` directory); it finishes every iteration and each iteration's loss equals an uninterrupted 2-rank
run's, bit for bit (CPU, dropout on). The background writer is slowed down by the ``sitecustomize`` of
``slow_async_writer/`` on the run's PYTHONPATH (launcher and workers) so that an async save is in flight for
about a second."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from longspan.cli import main
from longspan.training.checkpointing.save import get_checkpoint_dir, read_tracker
from longspan.config.schema.infra import FaultToleranceConfig
from longspan.training.resilience.heartbeat import HEARTBEAT_DIR_ENV
from tests.resilience.helpers import ENV, LONGSPAN, metrics_records, resilience_config, write_yaml
from tests.resilience.slow_async_writer.sitecustomize import WRITE_DELAY_S as WRITE_DELAY
from tests.training.pretrain_helpers import losses_by_iteration

pytestmark = pytest.mark.slow

ITERS = 24
RANK_TIMEOUT = 8.0
# every process of a run with this folder first on its PYTHONPATH writes checkpoints WRITE_DELAY seconds slower
SLOW_WRITER = Path(__file__).parent / "slow_async_writer"


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


def _saving(hb: Path, save: Path, rank: int, restart: int, after: int) -> Callable[[], Any]:
    """Rank ``rank`` of generation >= ``restart`` is inside a checkpoint save past iteration ``after``: heartbeat
    phase ``checkpoint`` for 0.1 s already (waiting for the previous async save to complete, which takes about
    WRITE_DELAY, so the kill lands well inside the save), a ``.partial`` directory on disk."""
    def check() -> Any:
        beat = _beats(hb).get(rank)
        if not beat or beat["restart"] < restart or beat["phase"] != "checkpoint" or beat["iteration"] <= after:
            return None
        if time.time() - beat["time"] < 0.1:
            return None
        return beat if any(save.glob("iter_*.partial")) else None

    return check


def _async_writing(hb: Path, save: Path, rank: int, restart: int, after: int) -> Callable[[], Any]:
    """An async save of an iteration > ``after`` is in flight while rank ``rank`` (generation >= ``restart``)
    trains on: the rank's heartbeat says ``iteration`` at or past the save's iteration (its save call has
    returned), and the save's ``.partial`` directory holds shard files but no ``.metadata`` yet."""
    def check() -> Any:
        beat = _beats(hb).get(rank)
        if not beat or beat["restart"] < restart or beat["phase"] != "iteration":
            return None
        for partial in save.glob("iter_*.partial"):
            saved_at = int(partial.name[len("iter_"):-len(".partial")])
            if after < saved_at <= beat["iteration"] and any(partial.glob("*.distcp")) \
                    and not (partial / ".metadata").exists():
                return {**beat, "partial": partial.name}
        return None

    return check


def _soak_config(tmp_path: Path, name: str, async_save: bool) -> Any:
    cfg = resilience_config(tmp_path, name, ITERS)
    cfg.checkpoint.save_interval = 2
    cfg.checkpoint.async_save = async_save
    if name != "ref":
        cfg.ft = FaultToleranceConfig(enable_ft_package=True)
    return cfg


def _start(cfg: Any, yaml: Path, hb: Path, max_restarts: int, initial_timeout: float = 120) -> subprocess.Popen:
    hb.mkdir()
    pythonpath = os.pathsep.join(p for p in (str(SLOW_WRITER), ENV.get("PYTHONPATH")) if p)
    env = {**ENV, HEARTBEAT_DIR_ENV: str(hb), "PYTHONPATH": pythonpath}
    args = ["pretrain", "--config", str(yaml), "--nproc-per-node", "2", "--max-restarts", str(max_restarts),
            "--ft-initial-rank-heartbeat-timeout", str(initial_timeout), "--ft-rank-heartbeat-timeout", str(RANK_TIMEOUT)]
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


def test_two_rank_run_survives_kill_hang_kill_during_save_and_during_async_save(pool2: Any, tmp_path: Path) -> None:
    started = time.time()
    ref = _soak_config(tmp_path, "ref", async_save=False)
    # the uninterrupted run: the command a launched worker runs, on the shared pool (no fresh interpreters)
    assert pool2.run(main, ["pretrain", "--config", str(write_yaml(ref, tmp_path / "ref.yaml"))], timeout=240) == [0, 0]
    reference = losses_by_iteration(ref)
    assert sorted(reference) == list(range(1, ITERS + 1))

    injected = []
    cfg = _soak_config(tmp_path, "soak", async_save=True)
    save = Path(cfg.checkpoint.save)
    hb = tmp_path / "hb"
    soak_started = time.time()
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

        beat = _wait_for(proc, "a checkpoint save after the restart",
                         _saving(hb, save, 1, beat["restart"] + 1, after=beat["iteration"]))
        os.kill(beat["pid"], signal.SIGKILL)
        injected.append(("SIGKILL rank 1 during a checkpoint save", beat["iteration"]))

        beat = _wait_for(proc, "an async save in flight after the restart",
                         _async_writing(hb, save, 0, beat["restart"] + 1, after=beat["iteration"]))
        os.kill(beat["pid"], signal.SIGKILL)
        in_flight = int(beat["partial"][len("iter_"):-len(".partial")])
        tracker_at_kill = read_tracker(save)
        tracked_complete = tracker_at_kill is not None and \
            (get_checkpoint_dir(save, tracker_at_kill) / ".metadata").is_file()
        injected.append((f"SIGKILL rank 0 during the async save {beat['partial']}", beat["iteration"]))
    finally:
        out = _finish(proc, hb)
    soak_s = time.time() - soak_started
    assert proc.returncode == 0, out[-4000:]

    faults = _faults(cfg)
    assert [(f["rank"], f["detection"]) for f in faults] == [(1, "rank_died"), (0, "rank_hung"), (1, "rank_died"),
                                                             (0, "rank_died")]
    remaining = [f["restarts_remaining"] for f in faults]
    assert remaining[0] == 6 and remaining == sorted(remaining, reverse=True) and len(set(remaining)) == 4
    assert "stopped (SIGSTOP)" in faults[1]["message"]
    assert faults[2]["rank_phase"] == "checkpoint"
    # Killed once silent for the timeout since its last heartbeat (which may precede the SIGSTOP by up to about the
    # write delay: the rank may have been waiting for an async save).
    silent = faults[1]["silent_s"]
    assert RANK_TIMEOUT <= silent < RANK_TIMEOUT + 2 and detected_after < RANK_TIMEOUT + 5
    progress = (save / "progress.txt").read_text()
    assert progress.count("Resilience event\tfault") == 4
    # The tracker never named the save in flight; the restarted job resumed from a complete checkpoint.
    assert tracked_complete and tracker_at_kill < in_flight
    assert "loaded checkpoint" in out and not list(save.glob("iter_*.partial"))

    losses = losses_by_iteration(cfg)
    assert sorted(losses) == list(range(1, ITERS + 1))
    assert losses == reference  # bit-exact across restarts, dropout on, async saves vs the synchronous reference
    logged = sum(1 for r in metrics_records(cfg) if r.get("phase", "train") == "train" and "losses" in r)
    lost = logged - ITERS
    print(f"\nfault soak: {len(injected)} faults injected, {len(faults)} survived, {lost} iterations re-run "
          f"(lost); hang detected {detected_after:.1f} s after the SIGSTOP, {silent:.1f} s after its last heartbeat "
          f"(timeout {RANK_TIMEOUT} s); soak run {soak_s:.0f} s, "
          f"test {time.time() - started:.0f} s: {injected}")


def test_simulated_hang_is_detected_and_survived(tmp_path: Path) -> None:
    """ft.simulate_fault: rank 1 stops itself (rank_hung) in the first run; the monitor kills it, the group restarts
    from the last checkpoint (no fault in the restarted run) and the run finishes."""
    cfg = resilience_config(tmp_path, "sim", 60)
    cfg.checkpoint.save_interval = 5
    cfg.ft = FaultToleranceConfig(enable_ft_package=True, simulate_fault=True, simulated_fault_type="rank_hung",
                                  simulated_fault_rank=1, simulated_fault_base_delay=2)
    hb = tmp_path / "hb"
    # The fault may strike during set-up on a slow machine: then the initial timeout (from the spawn) finds it.
    proc = _start(cfg, write_yaml(cfg, tmp_path / "sim.yaml"), hb, max_restarts=2, initial_timeout=45)
    out = _finish(proc, hb)
    assert proc.returncode == 0, out[-4000:]
    faults = _faults(cfg)
    assert len(faults) == 1 and faults[0]["rank"] == 1 and faults[0]["detection"] == "rank_hung"
    assert "stopped (SIGSTOP)" in faults[0]["message"]
    assert sorted(losses_by_iteration(cfg)) == list(range(1, 61))
