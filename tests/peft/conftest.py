"""Shared worker pools for the PEFT layout tests."""

from tests.parallel.conftest import pool2  # noqa: F401
