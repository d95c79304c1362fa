"""Fixtures shared by the training tests."""

from __future__ import annotations

import logging

import pytest


@pytest.fixture
def captured():
    records: list[str] = []

    class _H(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    lg = logging.getLogger("longspan")
    handler, old = _H(level=logging.INFO), lg.level
    lg.addHandler(handler)
    lg.setLevel(logging.INFO)
    yield records
    lg.removeHandler(handler)
    lg.setLevel(old)
