"""The suite's scheduling list names files that exist: a renamed or removed long file would otherwise drop out of
the front of the run without notice, and the run's end would again wait on it."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import LONGEST_FILES

ROOT = Path(__file__).resolve().parents[2]


def test_longest_files_exist_and_are_listed_once() -> None:
    missing = [name for name in LONGEST_FILES if not (ROOT / name).is_file()]
    assert not missing, f"tests/conftest.py LONGEST_FILES names files that do not exist: {missing}"
    assert len(set(LONGEST_FILES)) == len(LONGEST_FILES)
