"""The shared multi-process worker pools (tests/parallel/harness.py)."""

from tests.parallel.conftest import pool2  # noqa: F401
