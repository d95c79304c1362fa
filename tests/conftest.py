"""Session-wide test settings.

One intra-op thread per process: tests on a 2-core machine often run next to worker processes, and torch's
spinning OpenMP threads then slow tiny matmuls down by two orders of magnitude. Child processes inherit
OMP_NUM_THREADS.

The suite runs on pytest-xdist workers (pyproject's addopts: ``-n auto --dist loadfile``; ``-n 0`` runs it in
this process): each test is single-threaded, so one worker per core uses the cores a serial run leaves idle.
``--dist loadfile`` keeps a file's tests, and the module fixtures they share, on one worker; files holding
``slow`` tests are handed out first, the longest known ones (``LONGEST_FILES``) before them
(``--no-loadscope-reorder`` keeps this order, where xdist would otherwise put the files with the most tests
first), so the run does not end on one worker finishing a long file alone.
"""

from __future__ import annotations

import gc
import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from longspan.core.startup import import_frozen  # noqa: E402

import_frozen(["torch"])  # as `longspan` starts: the collector never rescans torch's module objects
import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.hookimpl(hookwrapper=True)
def pytest_collection(session):
    """Test modules import with the collector paused, and what they import is frozen: collections during the run
    scan only what the tests create."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.freeze()


def pytest_unconfigure(config) -> None:
    """Back to the interpreter's own exit: frozen objects whose finalizers need their modules (filelock's) would
    otherwise be finalized after those modules are gone, each printing an ignored exception."""
    gc.unfreeze()


# The longest files of the whole-suite run, longest first (seconds summed over their tests, measured on the
# 2-core machine). They are handed out before every other file, so the run's last files are short ones and the
# two workers finish together, where a long file picked up last would run alone on one worker.
LONGEST_FILES = (
    "tests/perf/test_compile_layouts.py",  # 156 s
    "tests/resilience/test_fault_soak.py",  # 141 s
    "tests/resilience/test_inprocess_restart.py",  # 118 s
    "tests/peft/test_peft_layouts.py",  # 114 s
    "tests/test_cli_e2e.py",  # 89 s
    "tests/perf/test_planner.py",  # 75 s
    "tests/models/mamba/test_mamba_layouts.py",  # 68 s
    "tests/parallel/test_gated_delta_net_layouts.py",  # 65 s
    "tests/parallel/test_layout_parity.py",  # 62 s
    "tests/parallel/test_mtp_layouts.py",  # 50 s
    "tests/models/t5/test_t5_layouts.py",  # 50 s
)


def pytest_collection_modifyitems(config, items) -> None:
    """``LONGEST_FILES`` first in their order, then the other files with end-to-end or multi-process (``slow``)
    tests, then the rest; each file's tests in their own order."""
    root = config.rootpath
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}

    def key(item) -> tuple[int, int]:
        name = item.path.relative_to(root).as_posix() if item.path.is_relative_to(root) else ""
        return (rank.get(name, len(rank)), item.path not in slow_files)

    items.sort(key=key)  # stable: the order within each group is kept


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
