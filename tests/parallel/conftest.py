"""Session-scoped worker pools for multi-process tests (see tests/parallel/harness.py).

``pool2`` and ``pool4`` keep 2 and 4 spawned workers alive for the whole session; tests submit callables with
``pool.run(fn, *args)``. Other test directories can reuse them with
``from tests.parallel.conftest import pool2, pool4  # noqa: F401`` in their own conftest.py.
"""

from __future__ import annotations

import pytest

from tests.parallel.harness import WorkerPool, close_shared_pools, get_shared_pool


@pytest.fixture(scope="session")
def pool2() -> WorkerPool:
    """A shared pool of 2 worker processes (started on first use)."""
    yield get_shared_pool(2)
    close_shared_pools()


@pytest.fixture(scope="session")
def pool4() -> WorkerPool:
    """A shared pool of 4 worker processes (started on first use)."""
    yield get_shared_pool(4)
    close_shared_pools()
