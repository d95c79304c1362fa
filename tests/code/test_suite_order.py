"""The suite's scheduling list names files that exist: a renamed or removed long file would otherwise drop out of
the front of the run without notice, and the run's end would again wait on it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import LONGEST_FILES, worker_cores

ROOT = Path(__file__).resolve().parents[2]


def test_longest_files_exist_and_are_listed_once() -> None:
    missing = [name for name in LONGEST_FILES if not (ROOT / name).is_file()]
    assert not missing, f"tests/conftest.py LONGEST_FILES names files that do not exist: {missing}"
    assert len(set(LONGEST_FILES)) == len(LONGEST_FILES)


def test_each_worker_gets_its_own_share_of_the_cores() -> None:
    assert [worker_cores(i, 2, [0, 1]) for i in range(2)] == [[0], [1]]
    assert [worker_cores(i, 3, [0, 1, 2, 3, 4, 5, 6]) for i in range(3)] == [[0, 1], [2, 3], [4, 5, 6]]
    assert [worker_cores(i, 2, [4, 6, 9]) for i in range(2)] == [[4], [6, 9]]  # the cores this run may use
    assert worker_cores(1, 4, [0, 1]) == [0, 1]  # more workers than cores: no pinning


def test_a_worker_and_the_processes_it_starts_run_on_its_cores(pytestconfig) -> None:
    """Under xdist this worker is confined to its share (a rank process started now inherits it)."""
    import os
    import subprocess
    import sys

    workerinput = getattr(pytestconfig, "workerinput", None)
    if workerinput is None:
        pytest.skip("not under xdist: no worker, nothing pinned")
    index, count = int(workerinput["workerid"].removeprefix("gw")), int(workerinput["workercount"])
    mine = os.sched_getaffinity(0)
    child = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                           capture_output=True, text=True, check=True).stdout.strip()
    assert child == str(sorted(mine))
    if count <= os.cpu_count():
        assert len(mine) <= max(1, os.cpu_count() // count) + os.cpu_count() % count
