"""In-process restart (``inprocess_restart``).

- The acceptance run (slow): a 2-rank ``longspan pretrain`` run (two pipeline stages, tied embeddings) whose rank 1
  is SIGKILLed from outside finishes every iteration with an uninterrupted run's losses, bit for bit (dropout on);
  rank 0 keeps its process (one pid for the whole run, two start-ups in it, restoring its local non-persistent
  checkpoint, making the embedding group of the new world), rank 1 gets a new one; the fault and the restart are
  log lines, progress.txt entries and metrics.jsonl records.
- The supervisor's rules with stand-in workers (tiny Python scripts, no torch): restarts, their budgets, concurrent
  faults, hung ranks, completion, exit codes, granularity — one test per config field.
- The worker side against a real TCPStore: the re-rendezvous barrier, the monitor thread's timestamps and its
  interruption of the main thread, the teardown; soft_timeout: a real training run (in this process, under
  run_worker) stalled in a pure-Python loop is interrupted and restarts in place with the uninterrupted losses.
- Config: YAML round trip (also under Megatron Bridge's class name) and the rules.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from longspan.cli import main
from longspan.core.errors import ConfigError, LaunchError, NotSupportedError
from longspan.training.config import ConfigContainer, FaultToleranceConfig, InProcessRestartConfig
from longspan.training.resilience import inprocess, supervisor
from longspan.training.resilience.inprocess import RestartAbort, WorkerMonitor, rendezvous
from longspan.training.resilience.supervisor import InProcessSupervisor, supervisor_reporter
from tests.resilience.helpers import ENV, LONGSPAN, metrics_records, resilience_config, write_yaml
from tests.training.pretrain_helpers import small_config

ITERS = 12


# ------------------------------------------------------------------------------------------ acceptance run


def _train_losses(cfg: Any) -> dict[int, float]:
    return {r["iteration"]: r["losses"]["lm loss"] for r in metrics_records(cfg)
            if r.get("phase", "train") == "train" and "losses" in r}


def _worker_pids(parent: int) -> dict[int, int]:
    """rank -> pid of the supervisor's current worker processes."""
    found = {}
    kids = subprocess.run(["pgrep", "-P", str(parent)], capture_output=True, text=True).stdout.split()
    for pid in kids:
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        rank = [item[5:] for item in environ if item.startswith(b"RANK=")]
        if rank:
            found[int(rank[0])] = int(pid)
    return found


class _KilledRun:
    """What ``_kill_rank_1_mid_run`` saw: the log, the pids of each rank, the iteration rank 1 died after."""

    def __init__(self, cfg: Any, out: str, seen: dict[int, set[int]], killed_at: int) -> None:
        self.cfg, self.out, self.seen, self.killed_at = cfg, out, seen, killed_at


def _kill_rank_1_mid_run(tmp_path: Path, cfg: Any, processes: int = 2, **fields: Any) -> _KilledRun:
    """Run ``cfg`` on ``processes`` worker processes under the in-process supervisor and SIGKILL rank 1 after its
    third iteration."""
    cfg.inprocess_restart = InProcessRestartConfig(
        enabled=True, granularity="rank", monitor_process_interval=0.1, monitor_thread_interval=0.2,
        last_call_wait=0.2, monitor_process_logdir=str(tmp_path / "monitor"), **fields)
    yaml = write_yaml(cfg, tmp_path / "ipr.yaml")
    log_path = tmp_path / "ipr.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(LONGSPAN + ["pretrain", "--config", str(yaml), "--nproc-per-node", str(processes)],
                                env=ENV, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    seen: dict[int, set[int]] = {rank: set() for rank in range(processes)}
    killed_at = None
    try:
        deadline = time.time() + 300
        while proc.poll() is None and time.time() < deadline:
            pids = _worker_pids(proc.pid)
            for rank, pid in pids.items():
                seen[rank].add(pid)
            done = max(_train_losses(cfg), default=0)
            if killed_at is None and done >= 3 and 1 in pids:
                os.kill(pids[1], signal.SIGKILL)
                killed_at = done
            time.sleep(0.02)
        proc.wait(timeout=10)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    out = log_path.read_text()
    assert proc.returncode == 0, out[-4000:]
    assert killed_at is not None and killed_at < ITERS
    return _KilledRun(cfg, out, seen, killed_at)


def _reference_losses(pool2: Any, cfg: Any, path: Path) -> dict[int, float]:
    """The uninterrupted 2-rank run of ``cfg``: ``longspan pretrain --config`` on the shared worker pool (the
    command a launched worker runs, without starting fresh interpreters)."""
    assert pool2.run(main, ["pretrain", "--config", str(write_yaml(cfg, path))], timeout=240) == [0, 0]
    reference = _train_losses(cfg)
    assert sorted(reference) == list(range(1, ITERS + 1))
    return reference


def _pp2_tied_config(tmp_path: Path, name: str) -> Any:
    """Two pipeline stages with tied embeddings: every step sums the tied gradients over the embedding group."""
    cfg = resilience_config(tmp_path, name, ITERS)
    cfg.model.pipeline_model_parallel_size = 2
    cfg.model.share_embeddings_and_output_weights = True
    return cfg


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_killed_rank_is_replaced_and_survivor_keeps_its_process(pool2: Any, tmp_path: Path) -> None:
    """PP2 with tied embeddings and only local non-persistent checkpoints before the end. The surviving stage's
    process keeps its modules across the restart and must create the embedding group of the new world with its
    replaced peer, not reuse the dead world's; it restores its own local file in place."""
    reference = _reference_losses(pool2, _pp2_tied_config(tmp_path, "ref"), tmp_path / "ref.yaml")
    cfg = _pp2_tied_config(tmp_path, "ipr")
    cfg.checkpoint.non_persistent_ckpt_type = "local"
    cfg.checkpoint.non_persistent_save_interval = 2
    cfg.checkpoint.non_persistent_local_ckpt_dir = str(tmp_path / "node_local")
    killed = _kill_rank_1_mid_run(tmp_path, cfg)
    out, seen, killed_at = killed.out, killed.seen, killed.killed_at

    losses = _train_losses(cfg)
    assert sorted(losses) == list(range(1, ITERS + 1))
    assert losses == reference  # bit-exact across the in-process restart, dropout on, the tied gradients summed again

    assert len(seen[0]) == 1, seen  # rank 0: one process for the whole run
    assert len(seen[1]) == 2, seen  # rank 1: the killed process and its replacement
    (rank0_pid,) = seen[0]
    banners = [line for line in out.splitlines() if line.startswith("longspan: samples train/valid/test")]
    assert len(banners) == 2 and all(line.endswith(f"pid {rank0_pid}") for line in banners)  # set up twice
    assert f"rank 0 (pid {rank0_pid}) rejoined in generation 1" in out
    assert "loaded local non-persistent checkpoint of iteration" in out  # printed by rank 0, the survivor

    events = [r for r in metrics_records(cfg) if r.get("phase") == "resilience"]
    assert [e["event"] for e in events] == ["fault", "restart"]
    fault, restart = events
    assert fault["rank"] == 1 and fault["detection"] == "rank_died" and fault["pid"] in seen[1]
    assert "killed by SIGKILL" in fault["message"]
    assert restart["replaced_ranks"] == [1] and restart["kept_ranks"] == [0] and restart["generation"] == 1
    progress = (Path(cfg.checkpoint.save) / "progress.txt").read_text()
    assert "Resilience event\tfault\trank 1" in progress and "Resilience event\trestart\tgeneration 1" in progress
    assert "resilience: fault: rank 1" in out and "resilience: restart: generation 1" in out
    monitor = (tmp_path / "monitor" / supervisor.MONITOR_LOG).read_text()
    rejoin = [line for line in monitor.splitlines() if "rejoined generation 1" in line]
    assert rejoin and "job finished with exit code 0 after 1 in-process restart(s)" in monitor
    print(f"\nin-process restart: rank 1 killed after iteration {killed_at}; {rejoin[0].split(': ', 1)[1]}")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_warm_reserve_takes_a_killed_ranks_place(pool2: Any, tmp_path: Path) -> None:
    """Three processes, active_world_size=2: the third waits as a warm reserve. Rank 1 is SIGKILLed after iteration
    3; the reserve's process (started before the fault) runs rank 1 from generation 1 and the run ends with an
    uninterrupted 2-rank run's losses bit for bit (dropout on); rank 0 keeps its process."""
    reference_cfg = resilience_config(tmp_path, "ref", ITERS)
    reference_cfg.checkpoint.save_interval = 2
    reference = _reference_losses(pool2, reference_cfg, tmp_path / "ref.yaml")
    cfg = resilience_config(tmp_path, "ipr", ITERS)
    cfg.checkpoint.save_interval = 2
    killed = _kill_rank_1_mid_run(tmp_path, cfg, processes=3, active_world_size=2)
    assert _train_losses(cfg) == reference
    (rank0_pid,) = killed.seen[0]
    (reserve_pid,) = killed.seen[2]  # the environment a process starts with: the reserve started as process 2
    events = [r for r in metrics_records(cfg) if r.get("phase") == "resilience"]
    assert [e["event"] for e in events] == ["fault", "restart"]
    fault, restart = events
    assert fault["rank"] == 1 and fault["pid"] in killed.seen[1]
    assert restart["reserve_ranks"] == [1] and restart["kept_ranks"] == [0] and restart["replaced_ranks"] == []
    assert f"taken by warm reserve process(es) (pids [{reserve_pid}])" in restart["message"]
    assert len(killed.seen[1]) == 2  # the killed process, then the new reserve that replaced it
    assert f"rank 0 (pid {rank0_pid}) rejoined in generation 1" in killed.out


# ------------------------------------------------------------------------------- supervisor, stand-in workers

# A stand-in worker: its behaviour per (generation, rank) comes from the PLAN environment variable, e.g.
# {"0:1": "kill"}; the default is to exit 0 once the RELEASE file exists (the test writes it after the expected
# number of restarts, so every planned fault happens before any rank finishes).
FAKE_WORKER = textwrap.dedent("""
    import json, os, signal, sys, time
    rank, gen = os.environ["RANK"], os.environ["LONGSPAN_INPROCESS_GENERATION"]
    with open(os.environ["FAKE_LOG"], "a") as fh:
        fh.write(f"{gen}:{rank}:{os.getpid()}:{time.time()}\\n")
    action = json.loads(os.environ["PLAN"]).get(f"{gen}:{rank}", "end")
    kind, _, arg = action.partition(":")
    if kind == "kill":
        time.sleep(float(arg or 0.3))
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "stop":
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGSTOP)
    elif kind == "stamp_stop":  # write a heartbeat and a progress stamp as a worker's monitor thread does, then freeze
        from datetime import timedelta
        import torch.distributed as dist
        host, port = os.environ["LONGSPAN_INPROCESS_STORE"].rsplit(":", 1)
        store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=60))
        store.set(f"heartbeat/{rank}", repr(time.time()))
        store.set(f"progress/{rank}", repr(time.time()))
        os.kill(os.getpid(), signal.SIGSTOP)
    elif kind == "finish_slowly":  # mark this rank as finished (exit code 0), then take long to shut down
        from datetime import timedelta
        import torch.distributed as dist
        host, port = os.environ["LONGSPAN_INPROCESS_STORE"].rsplit(":", 1)
        store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=60))
        store.set(f"progress/{rank}", repr(time.time()))
        store.set(f"exiting/{rank}", "0")
        time.sleep(60)
    elif kind == "deaf":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(60)
    elif kind == "graceful":  # like train.exit_signal_handler: exit cleanly on SIGTERM
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        time.sleep(60)
    elif kind == "sleep":
        time.sleep(float(arg))
    elif kind == "exit":
        time.sleep(0.3)
        if int(arg):
            print(f"Traceback ...\\nlongspan: error: rank {rank} failed with {arg}", file=sys.stderr)
        sys.exit(int(arg))
    else:
        end = time.time() + 60
        while not os.path.exists(os.environ["RELEASE"]) and time.time() < end:
            time.sleep(0.02)
""")


def _ipr(**fields: Any) -> InProcessRestartConfig:
    base = dict(enabled=True, granularity="rank", monitor_process_interval=0.05, last_call_wait=0.1,
                termination_grace_time=0.2, completion_timeout=20.0)
    base.update(fields)
    return InProcessRestartConfig(**base)


class _Run:
    def __init__(self, code: int, events: list[dict], sup: InProcessSupervisor, starts: list[tuple], logdir: Path):
        self.code, self.events, self.sup, self.starts, self.logdir = code, events, sup, starts, logdir

    def kinds(self) -> list[str]:
        return [e["event"] for e in self.events]


def _supervise(tmp_path: Path, plan: dict[str, str], world_size: int = 2, cls: type = InProcessSupervisor,
               restarts: int = 0, **fields: Any) -> _Run:
    """Run the supervisor on stand-in workers; those with the default action exit once ``restarts`` restarts
    have been reported."""
    save, metrics, logdir = tmp_path / "save", tmp_path / "metrics.jsonl", tmp_path / "monitor"
    fields.setdefault("monitor_process_logdir", str(logdir))
    ipr = _ipr(**fields)
    report = supervisor_reporter(str(save), str(metrics), world_size, ipr.monitor_process_logdir)
    tmp_path.mkdir(parents=True, exist_ok=True)
    release = tmp_path / "release"
    env = {"PLAN": json.dumps(plan), "FAKE_LOG": str(tmp_path / "starts.txt"), "RELEASE": str(release)}
    sup = cls(["-c", FAKE_WORKER], world_size, ipr, report, extra_env=env, command=[sys.executable])
    stop = threading.Event()

    def release_after_restarts() -> None:
        while not stop.is_set():
            text = metrics.read_text() if metrics.exists() else ""
            if text.count('"event": "restart"') >= restarts:
                release.touch()
                return
            time.sleep(0.02)

    watcher = threading.Thread(target=release_after_restarts, daemon=True)
    watcher.start()
    try:
        code = sup.run()
    finally:
        stop.set()
    events = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    starts = [tuple(line.split(":")) for line in (tmp_path / "starts.txt").read_text().splitlines()]
    return _Run(code, events, sup, starts, logdir)


def test_dead_rank_gets_a_new_process_in_the_next_generation(tmp_path: Path) -> None:
    r = _supervise(tmp_path, {"0:1": "kill"}, restarts=1)
    assert r.code == 0 and r.kinds() == ["fault", "restart"]
    fault, restart = r.events
    assert fault["rank"] == 1 and fault["detection"] == "rank_died" and "killed by SIGKILL" in fault["message"]
    assert "restarts remaining: unlimited" in fault["message"]
    assert restart["replaced_ranks"] == [1] and restart["kept_ranks"] == [0] and restart["generation"] == 1
    assert sorted((g, rk) for g, rk, *_ in r.starts) == [("0", "0"), ("0", "1"), ("1", "1")]
    progress = (tmp_path / "save" / "progress.txt").read_text()
    assert progress.count("Resilience event\tfault") == 1 and progress.count("Resilience event\trestart") == 1
    log = (r.logdir / supervisor.MONITOR_LOG).read_text()  # monitor_process_logdir
    assert "resilience: fault: rank 1" in log and "job finished with exit code 0 after 1 in-process restart(s)" in log


def test_a_live_reserve_takes_a_dead_ranks_place(tmp_path: Path) -> None:
    """active_world_size=2 of 3 processes: process 2 starts as a warm reserve; when rank 1 dies, the reserve gets
    rank 1 in generation 1 (the store's assignment) and the dead process is replaced by a new reserve."""
    r = _supervise(tmp_path, {"0:1": "kill"}, world_size=3, restarts=1, active_world_size=2)
    assert r.code == 0 and r.kinds() == ["fault", "restart"]
    fault, restart = r.events
    assert fault["rank"] == 1 and fault["process"] == 1 and "rank 1 (pid" in fault["message"]
    assert restart["reserve_ranks"] == [1] and restart["replaced_ranks"] == [] and restart["kept_ranks"] == [0]
    assert "new warm reserve process(es) [1]" in restart["message"]
    assert sorted((g, rk) for g, rk, *_ in r.starts) == [("0", "0"), ("0", "1"), ("0", "2"), ("1", "1")]
    assert r.sup.rank_of == {0: 0, 1: -1, 2: 1}
    assert [int(r.sup.store.get(inprocess.assignment_key(1, s))) for s in range(3)] == [0, -1, 1]
    assert [int(r.sup.store.get(inprocess.assignment_key(0, s))) for s in range(3)] == [0, 1, -1]


def test_no_monitor_log_without_a_directory(tmp_path: Path) -> None:
    r = _supervise(tmp_path, {}, monitor_process_logdir=None)
    assert r.code == 0 and not r.logdir.exists()


def test_max_iterations_bounds_the_restarts(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    plan = {"0:1": "kill", "1:1": "kill:0.1"}
    r = _supervise(tmp_path / "a", plan, restarts=99, max_iterations=1)
    assert r.code == 1 and r.kinds() == ["fault", "restart", "fault"]
    assert r.events[0]["restarts_remaining"] == 0 and "no restart left" in r.events[2]["message"]
    assert "in-process restart gave up: 1 restarts done, inprocess_restart.max_iterations=1" in capsys.readouterr().err
    r = _supervise(tmp_path / "b", plan, restarts=2, max_iterations=2)
    assert r.code == 0 and r.kinds() == ["fault", "restart", "fault", "restart"]


def test_max_rank_faults_bounds_one_ranks_failures(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    plan = {"0:1": "kill:0.3", "0:0": "kill:1.2"}  # one fault each: allowed with max_rank_faults=1
    r = _supervise(tmp_path / "a", plan, restarts=2, max_rank_faults=1)
    assert r.code == 0 and r.kinds() == ["fault", "restart", "fault", "restart"]
    r = _supervise(tmp_path / "b", {"0:1": "kill", "1:1": "kill"}, restarts=99, max_rank_faults=1)
    assert r.code == 1 and r.kinds() == ["fault", "restart", "fault"]
    assert "rank 1 failed 2 times, inprocess_restart.max_rank_faults=1" in capsys.readouterr().err


@pytest.mark.slow
def test_last_call_wait_handles_concurrent_faults_in_one_restart(tmp_path: Path) -> None:
    plan = {"0:0": "kill:0.3", "0:1": "kill:0.8"}
    r = _supervise(tmp_path / "joined", plan, restarts=1, last_call_wait=2.0)
    assert r.code == 0 and r.kinds() == ["fault", "fault", "restart"]
    assert r.events[2]["replaced_ranks"] == [0, 1]
    r = _supervise(tmp_path / "apart", plan, restarts=2, last_call_wait=0.0)
    assert r.code == 0 and r.kinds() == ["fault", "restart", "fault", "restart"]


def test_granularity_node_replaces_every_rank_of_the_node(tmp_path: Path) -> None:
    r = _supervise(tmp_path, {"0:1": "kill", "0:0": "sleep:30"}, restarts=1, granularity="node")
    assert r.code == 0 and r.kinds() == ["fault", "restart"]
    assert r.events[1]["replaced_ranks"] == [0, 1] and r.events[1]["kept_ranks"] == []
    assert sorted((g, rk) for g, rk, *_ in r.starts) == [("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")]


def test_barrier_timeout_bounds_a_start_without_heartbeat(tmp_path: Path) -> None:
    """Stand-in workers write no timestamps: a rank frozen (SIGSTOP) while starting is replaced after
    barrier_timeout."""
    r = _supervise(tmp_path, {"0:0": "stop", "1:0": "exit:0"}, world_size=1, barrier_timeout=1.0)
    assert r.code == 0 and r.kinds() == ["fault", "restart"]
    fault = r.events[0]
    assert fault["rank"] == 0 and fault["detection"] == "rank_hung"
    assert "no heartbeat 1." in fault["message"] and "inprocess_restart.barrier_timeout=1" in fault["message"]


@pytest.mark.parametrize("timeouts,expected", [
    ({"hard_timeout": 1.0}, r"no progress for 1.* s \(inprocess_restart.hard_timeout=1\)"),
    ({"heartbeat_timeout": 1.0}, r"no heartbeat for 1.* s \(inprocess_restart.heartbeat_timeout=1\)"),
])
@pytest.mark.slow
def test_stale_timestamps_get_a_frozen_rank_replaced(tmp_path: Path, timeouts: dict, expected: str) -> None:
    r = _supervise(tmp_path, {"0:0": "stamp_stop", "1:0": "exit:0"}, world_size=1, **timeouts)
    assert r.code == 0 and r.kinds() == ["fault", "restart"]
    assert r.events[0]["detection"] == "rank_hung" and re.search(expected, r.events[0]["message"])


@pytest.mark.slow
def test_termination_grace_time_before_sigkill(tmp_path: Path) -> None:
    """A rank that ignores SIGTERM is SIGKILLed termination_grace_time seconds later."""
    for grace in (0.1, 1.5):
        r = _supervise(tmp_path / str(grace), {"0:0": "deaf", "1:0": "exit:0"}, world_size=1, barrier_timeout=1.0,
                       termination_grace_time=grace)
        assert r.code == 0 and r.kinds() == ["fault", "restart"]
        first_start = float(next(s for s in r.starts if s[:2] == ("0", "0"))[3])
        replaced_at = float(next(s for s in r.starts if s[:2] == ("1", "0"))[3])
        # barrier_timeout (1 s, no heartbeat) + grace; the replacement's own start-up adds a little
        assert 1.0 + grace <= replaced_at - first_start < 1.0 + grace + 2.5


def test_completion_timeout_ends_ranks_that_do_not_finish(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    t0 = time.time()
    r = _supervise(tmp_path, {"0:1": "deaf"}, completion_timeout=0.5, termination_grace_time=0.1)
    assert r.code == 1 and r.kinds() == [] and time.time() - t0 < 20
    err = capsys.readouterr().err
    assert "did not exit within inprocess_restart.completion_timeout=0.5 s of the job's end (unfinished: [1])" in err


@pytest.mark.slow
def test_a_finished_rank_slow_to_exit_is_neither_hung_nor_failed(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    r = _supervise(tmp_path, {"0:0": "finish_slowly"}, world_size=1, hard_timeout=1.0, completion_timeout=2.0)
    assert r.code == 0 and r.kinds() == []  # not reported hung although its progress stamp is older than hard_timeout
    assert "rank(s) [0] did not exit within inprocess_restart.completion_timeout=2 s" in capsys.readouterr().err


@pytest.mark.parametrize("action,expected", [("graceful", 0), ("sleep:60", 128 + signal.SIGTERM)])
def test_sigterm_is_forwarded_to_the_workers(tmp_path: Path, action: str, expected: int) -> None:
    starts = tmp_path / "starts.txt"

    def terminate_when_started() -> None:
        end = time.time() + 60
        while time.time() < end and (not starts.exists() or len(starts.read_text().splitlines()) < 2):
            time.sleep(0.02)
        time.sleep(0.5)  # the workers have installed their handlers
        os.kill(os.getpid(), signal.SIGTERM)  # the supervisor's handler, installed for its run

    threading.Thread(target=terminate_when_started, daemon=True).start()
    r = _supervise(tmp_path, {"0:0": action, "0:1": action}, restarts=99)
    assert r.code == expected and r.kinds() == []


@pytest.mark.parametrize("codes,expected", [((17, 17), 17), ((16, 16), 16), ((2, 0), 2), ((3, 0), 1)])
def test_worker_exit_codes_end_the_job_without_restarts(tmp_path: Path, codes: tuple, expected: int,
                                                        capsys: pytest.CaptureFixture) -> None:
    r = _supervise(tmp_path, {f"0:{rank}": f"exit:{code}" for rank, code in enumerate(codes)})
    assert r.code == expected and r.kinds() == []
    err = capsys.readouterr().err.strip().splitlines()
    if expected in (1, 2):  # one line naming the rank, its code, its last stderr line and the full log
        assert len(err) == 1 and err[0].startswith(f"longspan: error: rank 0 exited with code {codes[0]}: rank 0 "
                                                   f"failed with {codes[0]} (full log: ")
        assert Path(err[0].rsplit("full log: ", 1)[1].rstrip(")")).is_file()
    else:  # the rerun state machine's codes are not errors of the launch
        assert err == []


@pytest.mark.slow
def test_monitor_process_interval_sets_how_often_workers_are_checked(tmp_path: Path) -> None:
    class Counting(InProcessSupervisor):
        polls = 0

        def _poll(self, exclude: Any = frozenset()) -> Any:
            type(self).polls += 1
            return super()._poll(exclude)

    counts = {}
    for interval in (0.02, 0.5):
        Counting.polls = 0
        _supervise(tmp_path / str(interval), {"0:0": "sleep:2", "0:1": "sleep:2"}, cls=Counting,
                   monitor_process_interval=interval)
        counts[interval] = Counting.polls
    assert counts[0.5] <= 8 and counts[0.02] > 3 * counts[0.5], counts


def test_stale_ranks_rules() -> None:
    ipr = _ipr(hard_timeout=10.0, heartbeat_timeout=5.0, barrier_timeout=20.0)
    started = {0: 100.0, 1: 100.0, 2: 100.0, 3: 80.0}
    stamps = {0: (None, None), 1: (108.0, 100.5), 2: (103.0, 111.0), 3: (None, None)}
    found = dict(supervisor.stale_ranks(112.0, stamps, started, ipr))
    assert set(found) == {1, 2, 3}  # rank 0: still starting, within barrier_timeout
    assert "no progress for 11.5 s" in found[1] and "no heartbeat for 9.0 s" in found[2]
    assert "no heartbeat 32.0 s after its start" in found[3]


# ----------------------------------------------------------------------------------- worker side, real store


@pytest.fixture()
def store() -> Any:
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    master.set(inprocess.GENERATION_KEY, "0")
    yield master


def _client(store: Any) -> Any:
    return inprocess.connect_store(f"127.0.0.1:{store.port}", 30)


def test_rendezvous_follows_the_newest_generation(store: Any) -> None:
    results: dict[int, int] = {}

    def arrive(rank: int, generation: int) -> None:
        results[rank] = rendezvous(_client(store), generation, rank, 2, timeout=20)

    survivor = threading.Thread(target=arrive, args=(0, 0))
    survivor.start()
    time.sleep(0.3)
    store.set(inprocess.GENERATION_KEY, "1")  # a fault: the replacement starts in generation 1
    replacement = threading.Thread(target=arrive, args=(1, 1))
    replacement.start()
    survivor.join(30)
    replacement.join(30)
    assert results == {0: 1, 1: 1}


def test_barrier_timeout_ends_the_wait(store: Any) -> None:
    t0 = time.time()
    with pytest.raises(LaunchError, match=r"waited 0.5 s .* 1/2 ranks arrived \(inprocess_restart.barrier_timeout\)"):
        rendezvous(_client(store), 0, 0, 2, timeout=0.5)
    assert time.time() - t0 < 5


def test_a_finishing_job_ends_the_wait(store: Any) -> None:
    store.set(inprocess.FINISHING_KEY, "1")
    assert inprocess.wait_for_next_generation(_client(store), 0, timeout=10) is None
    with pytest.raises(LaunchError, match="the job is ending"):
        rendezvous(_client(store), 0, 0, 2, timeout=10)


def _stamps(store: Any, key: str, seconds: float) -> set[str]:
    seen, end = set(), time.time() + seconds
    while time.time() < end:
        if store.check([key]):
            seen.add(store.get(key))
        time.sleep(0.02)
    return seen


def test_monitor_thread_writes_heartbeat_and_progress_at_their_intervals(store: Any) -> None:
    address = f"127.0.0.1:{store.port}"
    fast = WorkerMonitor(address, 0, _ipr(heartbeat_interval=30.0, progress_watchdog_interval=0.1))
    fast.start()
    try:
        beats = _stamps(store, inprocess.heartbeat_key(0), 1.0)
        progress = _stamps(store, inprocess.progress_key(0), 0.01)
        progress |= _stamps(store, inprocess.progress_key(0), 1.0)
    finally:
        fast.stop()
    assert len(beats) == 1 and len(progress) >= 4
    slow = WorkerMonitor(address, 1, _ipr(heartbeat_interval=0.1, progress_watchdog_interval=30.0))
    slow.start()
    try:
        beats = _stamps(store, inprocess.heartbeat_key(1), 1.0)
    finally:
        slow.stop()
    assert len(beats) >= 4


def _interrupted_within(store: Any, monitor_thread_interval: float, seconds: float) -> bool:
    """Run a busy main-thread loop for ``seconds`` in generation 0 while the job moves to generation 1."""
    monitor = WorkerMonitor(f"127.0.0.1:{store.port}", 0, _ipr(monitor_thread_interval=monitor_thread_interval))
    store.set(inprocess.GENERATION_KEY, "0")
    monitor.start()
    time.sleep(0.3)  # the first check has happened
    monitor.running(0)
    store.set(inprocess.GENERATION_KEY, "1")
    try:
        end = time.time() + seconds
        while time.time() < end:
            sum(range(1000))
        monitor.stopped()
        return False
    except RestartAbort:
        return True
    finally:
        monitor.stopped()
        monitor.stop()


def test_monitor_thread_interrupts_a_rank_left_in_an_older_generation(store: Any) -> None:
    assert _interrupted_within(store, 0.1, 3.0)
    assert not _interrupted_within(store, 30.0, 1.0)  # monitor_thread_interval: not checked again yet


def _run_worker(store: Any, tmp_path: Path, attempts: list) -> tuple[Any, list[Any]]:
    """run_worker as rank 0 of a one-rank job; ``attempts[i](store)`` is the i-th training attempt."""
    configs = []

    def make_config() -> Any:
        cfg = small_config(tmp_path)
        cfg.inprocess_restart = _ipr(monitor_thread_interval=0.05, last_call_wait=0.0, termination_grace_time=0.0)
        configs.append(cfg)
        return cfg

    def train(cfg: Any) -> int:
        assert cfg is configs[-1]  # every attempt gets a fresh configuration
        return attempts[len(configs) - 1](store)

    env = {"RANK": "0", "WORLD_SIZE": "1", inprocess.STORE_ENV: f"127.0.0.1:{store.port}",
           inprocess.GENERATION_ENV: "0"}
    try:
        return inprocess.run_worker(train, make_config, env), configs
    except BaseException as exc:  # noqa: BLE001 - returned for the test to inspect
        return exc, configs


def _peer_died(store: Any) -> int:
    store.set(inprocess.GENERATION_KEY, "1")  # what the supervisor does after a peer's death
    raise RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer")


def _busy_until_interrupted(store: Any) -> int:
    store.set(inprocess.GENERATION_KEY, "1")
    end = time.time() + 30
    while time.time() < end:
        sum(range(1000))
    return 5


def test_worker_restarts_in_place_after_a_peer_failure(store: Any, tmp_path: Path) -> None:
    for first in (_peer_died, _busy_until_interrupted):  # a failed collective; the monitor thread's interruption
        store.set(inprocess.GENERATION_KEY, "0")
        result, configs = _run_worker(store, tmp_path, [first, lambda s: 17])
        assert result == 17 and len(configs) == 2  # the second attempt ran, in generation 1
        assert int(store.add(inprocess.arrived_key(1), 0)) >= 1
        assert store.get(inprocess.exiting_key(0)) == b"17"
        store.delete_key(inprocess.arrived_key(1))


@pytest.mark.slow
def test_worker_error_without_a_new_generation_is_raised(store: Any, tmp_path: Path) -> None:
    def user_error(s: Any) -> int:
        raise ConfigError("model.x=1 is bad")

    t0 = time.time()
    result, configs = _run_worker(store, tmp_path, [user_error])
    assert isinstance(result, ConfigError) and len(configs) == 1
    assert store.get(inprocess.exiting_key(0)) == b"2"  # the code the CLI gives a longspan error
    assert time.time() - t0 < 15  # waited only a short grace for a peer's fault to show


SOFT_TIMEOUT = 3.0  # well above a tiny iteration or checkpoint save on a loaded machine: no spurious restart
SOFT_ITERS = 6


def _soft_timeout_config(tmp_path: Path, name: str) -> Any:
    cfg = resilience_config(tmp_path, name, SOFT_ITERS)
    cfg.checkpoint.save_interval = 2
    cfg.inprocess_restart = _ipr(soft_timeout=SOFT_TIMEOUT, hard_timeout=120.0, monitor_thread_interval=0.05,
                                 progress_watchdog_interval=0.1, last_call_wait=0.0, termination_grace_time=0.0)
    return cfg


@pytest.mark.timeout(300)
def test_soft_timeout_interrupts_a_stalled_rank_in_place(store: Any, tmp_path: Path, monkeypatch: Any) -> None:
    """A rank stuck in a pure-Python loop after iteration 3 makes no progress: its monitor thread interrupts it at
    soft_timeout and moves the job to the next generation; the same process resumes from the iteration-2 checkpoint
    and ends with the uninterrupted run's losses (dropout on)."""
    from longspan.training import train as train_loop
    from longspan.training.pretrain import pretrain

    reference_cfg = _soft_timeout_config(tmp_path, "ref")
    reference_cfg.inprocess_restart = None
    pretrain(reference_cfg)
    reference = _train_losses(reference_cfg)
    assert sorted(reference) == list(range(1, SOFT_ITERS + 1))

    stall: dict[str, float] = {}
    after_iteration = train_loop.after_iteration

    def stall_once_after_iteration_3(state: Any) -> None:
        after_iteration(state)
        if state.train_state.step == 3 and "start" not in stall:
            stall["start"] = time.monotonic()
            try:
                while time.monotonic() - stall["start"] < 60:  # no progress, never returns to the loop
                    sum(range(100))
            finally:
                stall["end"] = time.monotonic()

    monkeypatch.setattr(train_loop, "after_iteration", stall_once_after_iteration_3)
    monkeypatch.setenv(inprocess.STORE_ENV, f"127.0.0.1:{store.port}")
    configs = []

    def make_config() -> Any:
        configs.append(_soft_timeout_config(tmp_path, "ipr"))
        return configs[-1]

    env = {"RANK": "0", "WORLD_SIZE": "1", inprocess.STORE_ENV: f"127.0.0.1:{store.port}",
           inprocess.GENERATION_ENV: "0"}
    pid = os.getpid()
    assert inprocess.run_worker(lambda cfg: int(getattr(pretrain(cfg), "exit_code", None) or 0), make_config, env) == 0
    assert os.getpid() == pid and len(configs) >= 2  # restarted in this process
    stalled_for = stall["end"] - stall["start"]
    assert 0.9 * SOFT_TIMEOUT <= stalled_for < SOFT_TIMEOUT + 30, stall  # interrupted at soft_timeout, not left
    generation, _, seconds = store.get(inprocess.soft_timeout_key(0)).decode().partition(":")
    assert int(store.get(inprocess.GENERATION_KEY)) >= 1 and float(seconds) >= SOFT_TIMEOUT
    losses = _train_losses(configs[-1])
    assert sorted(losses) == list(range(1, SOFT_ITERS + 1)) and losses == reference


def test_progress_stamp_is_the_training_loops_while_it_runs() -> None:
    """hard_timeout reads the same progress the soft timeout does: frozen at the loop's last progress while the
    loop runs (a rank the interruption cannot reach stops progressing), the monitor's own time outside it."""
    monitor = WorkerMonitor("127.0.0.1:1", 0, _ipr())
    monitor.start = lambda: None  # no thread: only the bookkeeping the main thread does
    inprocess.report_progress()  # not supervised: nothing to report to
    inprocess._active_monitor = monitor
    try:
        monitor.running(0)
        assert monitor.progress_stamp(123.0) == 123.0  # setup: not watched
        inprocess.start_progress_watch()
        started = monitor.progress_stamp(1e12)
        assert started < 1e12
        time.sleep(0.01)
        inprocess.report_progress()
        assert started < monitor.progress_stamp(1e12) < 1e12
        inprocess.end_progress_watch()
        assert monitor.progress_stamp(1e12) == 1e12
        inprocess.start_progress_watch()
        monitor.stopped()  # the attempt ended (interrupted or not)
        assert monitor.progress_stamp(1e12) == 1e12
    finally:
        inprocess._active_monitor = None


def test_a_restarting_rank_lets_go_of_its_failed_attempts_frames() -> None:
    """The interrupted attempt's frames hold its model and process groups; released before the teardown, the groups
    are freed and their sockets close, so a peer blocked in a collective with this rank fails at once (by hand: a
    2-rank run restarted 1.3 s after a peer's soft timeout, instead of waiting for hard_timeout)."""
    import gc
    import weakref

    class Held:
        pass

    def attempt() -> None:
        held = Held()  # noqa: F841 - what a frame of the failed attempt keeps alive
        try:
            raise RuntimeError("collective failed")
        except RuntimeError:
            raise RestartAbort()

    try:
        attempt()
    except RestartAbort as caught:
        exc = caught
    ref = weakref.ref(exc.__context__.__traceback__.tb_frame.f_locals["held"])
    inprocess._release_frames(exc)
    gc.collect()
    assert ref() is None and exc.__traceback__ is None


class _Exited:
    def __init__(self, pid: int) -> None:
        self.pid = pid

    def poll(self) -> int:
        return 0


@pytest.mark.parametrize("max_iterations,expected", [(None, None), (0, 1)])
def test_supervisor_reports_a_soft_timeout_restart(store: Any, max_iterations: Any, expected: Any) -> None:
    """A worker's soft timeout moved the job to generation 1: the supervisor reports the fault and an in-place
    restart (no process replaced) and counts it against max_iterations."""
    events: list[tuple[str, str, dict]] = []
    sup = InProcessSupervisor([], 2, _ipr(soft_timeout=5.0, max_iterations=max_iterations),
                              lambda *event: events.append(event))
    sup.store, sup.procs = store, {0: _Exited(100), 1: _Exited(101)}
    assert sup._adopt_worker_restart() is None and events == []  # nothing happened
    store.set(inprocess.soft_timeout_key(1), "0:5.25")  # what rank 1's monitor thread writes, then the bump
    store.set(inprocess.GENERATION_KEY, "1")
    assert sup._adopt_worker_restart() == expected
    fault = events[0]
    assert fault[0] == "fault" and fault[2]["rank"] == 1 and fault[2]["detection"] == "soft_timeout"
    assert "no progress for 5.2 s (inprocess_restart.soft_timeout=5); interrupted in place" in fault[1]
    assert not store.check([inprocess.soft_timeout_key(1)])
    if expected is None:
        assert [e[0] for e in events] == ["fault", "restart"] and sup.generation == 1 and sup.restarts == 1
        assert events[1][2]["replaced_ranks"] == [] and events[1][2]["kept_ranks"] == [0, 1]
    else:
        assert [e[0] for e in events] == ["fault"] and store.check([inprocess.FINISHING_KEY])


def test_teardown_forgets_the_process_group_and_empties_the_cuda_cache(store: Any, monkeypatch: Any) -> None:
    from longspan.parallel import init as parallel_init

    dist.init_process_group("gloo", store=dist.PrefixStore("t", store), rank=0, world_size=1)
    emptied = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    inprocess.reset_process_state(empty_cuda_cache=False)
    assert not dist.is_initialized() and not parallel_init.is_initialized() and emptied == []
    inprocess.reset_process_state(empty_cuda_cache=True)
    assert emptied == [1]


@pytest.mark.slow
def test_leaving_the_interruptible_span_leaves_python_fast() -> None:
    """A run that entered and left the span (every attempt does) must not leave CPython's eval breaker set
    (cancelling with PyThreadState_SetAsyncExc(tid, NULL) did): a torch-profiled loop with Python stacks then
    crawled, and tests/training's profiler test hung after this file's tests. Fresh interpreter, so the
    state of this process does not matter."""
    script = textwrap.dedent("""
        import time
        from torch.profiler import profile
        from longspan.training.config import InProcessRestartConfig
        from longspan.training.resilience.inprocess import WorkerMonitor

        monitor = WorkerMonitor("127.0.0.1:1", 0, InProcessRestartConfig(enabled=True))
        monitor.running(0)
        monitor.stopped()
        start = time.perf_counter()
        with profile(with_stack=True):
            sum(i for i in range(200_000))
        print(f"{time.perf_counter() - start:.2f}")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=ENV)
    assert out.returncode == 0, out.stderr[-2000:]
    assert float(out.stdout.strip().splitlines()[-1]) < 20.0  # ~1 s normally; the stuck eval breaker: minutes


def test_teardown_waits_for_a_background_save_of_the_failed_run(monkeypatch: Any) -> None:
    """A restarting worker lets an async save of the failed run end before its process groups go (the save's
    thread runs collectives on the checkpoint group), then forgets it; one still running at the deadline is
    dropped with a warning."""
    from concurrent.futures import Future

    from longspan.training.checkpointing import async_save as async_checkpoint

    finishing: Future = Future()
    stuck: Future = Future()
    threading.Timer(0.3, finishing.set_result, args=(None,)).start()
    monkeypatch.setattr(async_checkpoint, "_in_flight", [finishing])
    t0 = time.monotonic()
    inprocess.reset_process_state(empty_cuda_cache=False)
    assert finishing.done() and time.monotonic() - t0 >= 0.25 and async_checkpoint._in_flight == []
    monkeypatch.setattr(async_checkpoint, "_in_flight", [stuck])
    monkeypatch.setattr(inprocess, "_ASYNC_SAVE_GRACE_S", 0.2)
    assert async_checkpoint.abandon_in_flight_saves(0.2) == 1 and async_checkpoint._in_flight == []


# ------------------------------------------------------------------------------------------------- config


def test_yaml_round_trip_and_bridge_class_name(tmp_path: Path) -> None:
    cfg = small_config(tmp_path)
    cfg.inprocess_restart = InProcessRestartConfig(enabled=True, max_iterations=3, granularity="rank",
                                                   hard_timeout=30.0, monitor_process_logdir="/tmp/x")
    path = tmp_path / "c.yaml"
    cfg.to_yaml(str(path))
    assert ConfigContainer.from_yaml(str(path)).inprocess_restart == cfg.inprocess_restart
    data = cfg.to_dict()
    data["inprocess_restart"]["_target_"] = "megatron.bridge.training.config.InProcessRestartConfig"
    assert ConfigContainer.from_dict(data).inprocess_restart == cfg.inprocess_restart


@pytest.mark.parametrize("field,value,error,match", [
    ("soft_timeout", 90.0, ConfigError, "inprocess_restart.soft_timeout=90.0 is not valid: use fewer seconds than "
                                         "inprocess_restart.hard_timeout=90.0"),
    ("active_world_size", 0, ConfigError, "inprocess_restart.active_world_size=0 is not valid"),
    ("hard_timeout", 0, ConfigError, "inprocess_restart.hard_timeout=0 is not valid"),
    ("last_call_wait", -1, ConfigError, "inprocess_restart.last_call_wait=-1 is not valid"),
    ("max_iterations", -1, ConfigError, "inprocess_restart.max_iterations=-1 is not valid"),
    ("max_rank_faults", 1.5, ConfigError, "inprocess_restart.max_rank_faults=1.5 has the wrong type"),
    ("granularity", "job", ConfigError, "inprocess_restart.granularity='job' is not valid"),
])
def test_config_rules(tmp_path: Path, field: str, value: Any, error: type, match: str) -> None:
    cfg = small_config(tmp_path)
    cfg.inprocess_restart = InProcessRestartConfig(enabled=True, **{field: value})
    with pytest.raises(error, match=match.replace("(", r"\(")):
        cfg.validate(world_size=1)


def test_ft_and_inprocess_restart_exclude_each_other(tmp_path: Path) -> None:
    cfg = small_config(tmp_path)
    cfg.inprocess_restart = InProcessRestartConfig(enabled=True)
    cfg.ft = FaultToleranceConfig(enable_ft_package=True)
    with pytest.raises(NotSupportedError, match="ft.enable_ft_package=True is not supported yet"):
        cfg.validate(world_size=1)


def test_pretrain_outside_the_supervisor_is_rejected(tmp_path: Path, monkeypatch: Any) -> None:
    from longspan.training.pretrain import pretrain

    monkeypatch.delenv(inprocess.STORE_ENV, raising=False)
    cfg = small_config(tmp_path)
    cfg.inprocess_restart = InProcessRestartConfig(enabled=True)
    with pytest.raises(NotSupportedError, match="needs longspan's in-process supervisor"):
        pretrain(cfg)


def test_cli_rejects_launcher_restarts_and_several_nodes(tmp_path: Path) -> None:
    from longspan.cli import main

    cfg = small_config(tmp_path)
    cfg.inprocess_restart = InProcessRestartConfig(enabled=True)
    yaml = str(write_yaml(cfg, tmp_path / "c.yaml"))
    assert main(["pretrain", "--config", yaml, "--nproc-per-node", "2", "--max-restarts", "2"]) == 2
    assert main(["pretrain", "--config", yaml, "--nproc-per-node", "2", "--nnodes", "2"]) == 2
    cfg.inprocess_restart.active_world_size = 3  # more workload ranks than processes
    yaml = str(write_yaml(cfg, tmp_path / "reserve.yaml"))
    assert main(["pretrain", "--config", yaml, "--nproc-per-node", "2"]) == 2
