"""The in-process elastic launcher: success, one-line failure reports, exit codes, SIGTERM forwarding.

The workers run ``python -m tests.parallel.launch_entry MODE`` (a trivial entrypoint), not the training CLI.
"""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from longspan.core.errors import LaunchError
from longspan.parallel.launcher import WorkerFailure, format_failure, launch, parse_nnodes

REPO = Path(__file__).resolve().parents[2]
ENTRY = "tests.parallel.launch_entry"


@pytest.fixture
def worker_env(monkeypatch):
    # workers inherit the launcher's environment: make the repo importable and keep them single-threaded
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")


# --------------------------------------------------------------------------- pure parts


def test_parse_nnodes():
    assert parse_nnodes("2") == (2, 2) and parse_nnodes("1:4") == (1, 4) and parse_nnodes(3) == (3, 3)
    for bad in ("0", "4:2", "x", "1:2:3"):
        with pytest.raises(LaunchError, match="--nnodes"):
            parse_nnodes(bad)


def test_bad_launch_arguments_raise_before_starting_anything():
    with pytest.raises(LaunchError, match="--nproc-per-node=0"):
        launch(["x"], 0)
    with pytest.raises(LaunchError, match="needs --rdzv-endpoint"):
        launch(["x"], 1, nnodes="2")
    with pytest.raises(LaunchError, match="--node-rank=2"):
        launch(["x"], 1, nnodes="2", rdzv_backend="static", rdzv_endpoint="localhost:1", node_rank=2)


def test_format_failure_is_one_line():
    line = format_failure(WorkerFailure(3, 1, 2, "longspan: error: model.num_layers=-1 must be positive", "/l/3"))
    assert line == ("longspan: error: rank 3 exited with code 2: model.num_layers=-1 must be positive "
                    "(full log: /l/3)")
    assert format_failure(WorkerFailure(0, 0, -9, "")) == "longspan: error: rank 0 was killed by SIGKILL"


# --------------------------------------------------------------------------- real launches


@pytest.mark.slow
def test_two_workers_succeed_and_stdout_is_prefixed(worker_env, capfd):
    assert launch(["ok"], 2, module=ENTRY) == 0
    out = capfd.readouterr().out
    assert "[rank0]:hello from rank 0 of 2" in out and "[rank1]:hello from rank 1 of 2" in out


@pytest.mark.slow
def test_failing_worker_is_one_line_naming_rank_and_error(worker_env, capfd, tmp_path):
    start = time.monotonic()
    assert launch(["fail-rank1"], 2, module=ENTRY, log_dir=str(tmp_path)) == 1
    assert time.monotonic() - start < 25  # rank 0 (sleeping 30 s) is stopped, not waited for
    err = capfd.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("longspan: error: rank 1 exited with code 1: ValueError: boom on purpose")
    assert "Traceback" not in err


@pytest.mark.slow
def test_user_error_in_worker_exits_2_with_its_last_stderr_line(worker_env, capfd, tmp_path):
    assert launch(["usererror-rank1"], 2, module=ENTRY, log_dir=str(tmp_path)) == 2
    lines = [ln for ln in capfd.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1
    log_file = lines[0].split("(full log: ")[1].rstrip(")")
    assert log_file.startswith(str(tmp_path)) and "some warning first" in Path(log_file).read_text()
    assert lines[0].startswith("longspan: error: rank 1 exited with code 2: model.num_layers=-1 must be positive")


@pytest.mark.slow
def test_processes_in_a_real_process_group(worker_env, tmp_path):
    assert launch(["dist", str(tmp_path)], 2, module=ENTRY) == 0
    assert sorted(p.read_text() for p in tmp_path.glob("sum.*")) == ["3.0", "3.0"]  # (0+1) + (1+1)


@pytest.mark.slow
def test_sigterm_is_forwarded_and_clean_exit_is_zero(worker_env, tmp_path):
    code = (f"import sys; from longspan.parallel.launcher import launch; "
            f"sys.exit(launch(['wait-sigterm', {str(tmp_path)!r}], 2, module={ENTRY!r}))")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.monotonic() + 90
        while len(glob.glob(str(tmp_path / "ready.*"))) < 2:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "workers never became ready"
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert sorted(p.name for p in tmp_path.glob("saved.*")) == ["saved.0", "saved.1"]


@pytest.mark.slow
def test_two_nodes_on_loopback_with_c10d_rendezvous(worker_env, tmp_path):
    from tests.parallel.harness import free_port

    endpoint = f"127.0.0.1:{free_port()}"
    code = ("import sys; from longspan.parallel.launcher import launch; "
            f"sys.exit(launch(['dist', {str(tmp_path)!r}], 1, nnodes='2', rdzv_endpoint={endpoint!r}, "
            f"rdzv_id='twonodes', module={ENTRY!r}))")
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    try:
        results = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert [p.returncode for p in procs] == [0, 0], results
    assert sorted(p.name for p in tmp_path.glob("sum.*")) == ["sum.0", "sum.1"]
    assert {p.read_text() for p in tmp_path.glob("sum.*")} == {"3.0"}


def test_failure_quotes_the_first_rank_whose_log_gives_a_reason(tmp_path):
    """A user error is printed by rank 0 alone; rank 3, failing first with an empty log, must not hide it."""
    from types import SimpleNamespace

    from longspan.parallel.launcher import _pick_failure

    logs = {r: tmp_path / f"{r}.log" for r in range(4)}
    for r, path in logs.items():
        path.write_text("longspan: error: model.tensor_model_parallel_size=4 must divide num_query_groups=2\n"
                        if r == 0 else "")
    failures = {r: SimpleNamespace(exitcode=2, timestamp=10 - r, local_rank=r, error_file=None) for r in range(4)}
    killed = {5: SimpleNamespace(exitcode=-9, timestamp=0, local_rank=5, error_file=None)}
    stderrs = SimpleNamespace(stderrs={r: str(p) for r, p in logs.items()})
    failure = _pick_failure({**failures, **killed}, stderrs, str(tmp_path))
    assert (failure.rank, failure.exitcode, failure.log_file) == (0, 2, str(logs[0]))
    assert format_failure(failure).startswith("longspan: error: rank 0 exited with code 2: "
                                              "model.tensor_model_parallel_size=4 must divide")
    logs[0].write_text("")  # no log has a reason: the first failure by time is reported, empty-handed
    assert _pick_failure(failures, stderrs, str(tmp_path)).rank == 3
