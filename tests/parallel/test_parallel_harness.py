"""The multi-process harness itself: results per rank, errors with rank and traceback, hangs killed quickly."""

from __future__ import annotations

import os
import time

import pytest

from tests.parallel.harness import HarnessTimeout, WorkerError, init_gloo

# starting a worker pool takes 5-20 s on a busy 2-core machine
pytestmark = pytest.mark.slow


def _rank_info(offset):
    import torch
    import torch.distributed as dist

    init_gloo(timeout_s=30)
    t = torch.tensor([float(dist.get_rank() + offset)])
    dist.all_reduce(t)
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": t.item(),
            "omp": os.environ["OMP_NUM_THREADS"], "threads": torch.get_num_threads(),
            "ifname": os.environ["GLOO_SOCKET_IFNAME"], "pid": os.getpid(), "port": os.environ["MASTER_PORT"]}


def _echo(x):
    return x


def _raise_on_rank1():
    import torch.distributed as dist

    init_gloo(timeout_s=30)
    if dist.get_rank() == 1:
        raise ValueError("deliberate failure on rank 1")
    dist.barrier()  # rank 0 waits here for a partner that never comes
    return "unreachable"


def _hang_on_rank0():
    if int(os.environ["RANK"]) == 0:
        time.sleep(600)
    return "done"


def _still_initialized():
    import torch.distributed as dist

    return dist.is_initialized()


def test_two_ranks_results_and_env(pool2):
    first = pool2.run(_rank_info, 10)
    assert [r["rank"] for r in first] == [0, 1]
    assert all(r["world"] == 2 and r["sum"] == 10 + 11 for r in first)  # (0+10) + (1+10)
    assert all(r["omp"] == "1" and r["threads"] == 1 and r["ifname"] == "lo" for r in first)
    second = pool2.run(_rank_info, 0)
    # same processes (persistent pool), fresh port per task, process group torn down in between
    assert [r["pid"] for r in second] == [r["pid"] for r in first]
    assert second[0]["port"] != first[0]["port"]
    assert pool2.run(_still_initialized) == [False, False]


def test_four_ranks_per_rank_arguments(pool4):
    assert pool4.run_per_rank(_echo, [(i * i,) for i in range(4)]) == [0, 1, 4, 9]
    out = pool4.run(_rank_info, 1)
    assert [r["sum"] for r in out] == [10.0] * 4  # 1+2+3+4


def test_exception_is_reraised_with_rank_and_traceback_quickly(pool2):
    start = time.monotonic()
    with pytest.raises(WorkerError) as exc:
        pool2.run(_raise_on_rank1, timeout=60)
    elapsed = time.monotonic() - start
    assert exc.value.rank == 1 and exc.value.exc_type == "ValueError"
    assert "deliberate failure on rank 1" in str(exc.value)
    assert "_raise_on_rank1" in exc.value.remote_traceback  # the worker's own traceback
    assert elapsed < 20, elapsed  # grace period, not the 30 s collective timeout
    # the pool restarts and works again
    assert pool2.run(_echo, "again") == ["again", "again"]


def test_hang_is_killed_at_the_timeout(pool2):
    starts = pool2.starts
    start = time.monotonic()
    with pytest.raises(HarnessTimeout, match=r"ranks \[0\] did not finish"):
        pool2.run(_hang_on_rank0, timeout=3)
    assert time.monotonic() - start < 10
    assert pool2.run(_echo, 1) == [1, 1]
    assert pool2.starts == starts + 1  # killed and restarted once
