"""Session-wide test settings.

One intra-op thread per process: tests on a 2-core machine often run next to worker processes, and torch's
spinning OpenMP threads then slow tiny matmuls down by two orders of magnitude. Child processes inherit
OMP_NUM_THREADS.

The suite runs on pytest-xdist workers (pyproject's addopts: ``-n auto --dist loadfile``; ``-n 0`` runs it in
this process): each test is single-threaded, so one worker per core uses the cores a serial run leaves idle.
``--dist loadfile`` keeps a file's tests, and the module fixtures they share, on one worker; files holding
``slow`` tests are handed out first (``--no-loadscope-reorder`` keeps this order, where xdist would otherwise put
the files with the most tests first), so the run does not end on one worker finishing a long file alone.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items) -> None:
    """Files with end-to-end or multi-process (``slow``) tests first, each file's tests in their own order."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: the order within each group is kept


def pytest_xdist_auto_num_workers(config) -> int:
    """How many workers ``-n auto`` starts: one per core this process may use, at most 8 (the multi-process
    tests start 2-4 processes each); none when there is one core, or when the command names single tests or
    one file, which workers would only slow down. ``PYTEST_XDIST_AUTO_NUM_WORKERS`` overrides it, as in xdist."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    args = [str(a) for a in config.args]
    if any("::" in a for a in args) or (len(args) == 1 and os.path.isfile(args[0])):
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return 0 if cores < 2 else min(cores, 8)
