"""Every function of Bridge's training.train (the spec page) exists in longspan.training.train with its parameters,
read from the seed text itself."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

import longspan.training.train as train_module

SEED = Path(__file__).resolve().parents[2].parent / "shared" / "seeds" / "001_e7c05531156d27d2.txt"


def _seed_signatures() -> dict[str, list[tuple[str, bool]]]:
    """{function: [(parameter, has_default)]} parsed from the seed's API section."""
    lines = SEED.read_text(encoding="utf-8").splitlines()
    functions: dict[str, list[tuple[str, bool]]] = {}
    current = None
    for line in lines:
        start = re.match(r"^- bridge\.training\.train\.(\w+)\((.*)$", line)
        if start:
            current = start.group(1)
            functions[current] = []
            inline = start.group(2).rstrip(")#").strip()
            for part in filter(None, (p.strip() for p in inline.split(","))):
                functions[current].append((part.split(":")[0].strip(), "=" in part))
            if line.rstrip().endswith(")") or line.rstrip().endswith("#"):
                current = None
            continue
        param = re.match(r"^- (\w+): .*$", line)
        if current and param:
            functions[current].append((param.group(1), " = " in line))
        elif current:
            current = None
    return functions


# Skip only when ../shared itself is absent (a clone on its own); beside ../shared a missing seed fails.
@pytest.mark.skipif(not SEED.parents[1].is_dir(), reason=f"{SEED.parents[1]} is absent")
def test_every_seed_001_function_exists_with_its_parameters() -> None:
    signatures = _seed_signatures()
    assert len(signatures) == 12  # the module's function table lists twelve
    for name, params in signatures.items():
        target = getattr(train_module, name)
        actual = inspect.signature(target).parameters
        assert [p for p, _ in params] == list(actual), name
        for param, has_default in params:
            assert (actual[param].default is not inspect.Parameter.empty) == has_default, f"{name}({param})"
