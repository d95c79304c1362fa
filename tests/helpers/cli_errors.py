"""The shape of a user error at the command line: exit 2 and one line, no traceback."""

from __future__ import annotations


def assert_one_line(code: int, err: str, fragment: str) -> None:
    """``longspan`` exited 2 with one stderr line that starts with ``longspan`` and holds ``fragment``."""
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1, err
    assert lines[0].startswith("longspan"), lines[0]
    assert fragment in lines[0], lines[0]
    assert "Traceback" not in err
