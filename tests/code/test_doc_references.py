"""Docstrings, comments and docs name only longspan modules and files that exist.

Two kinds of reference are checked, in every ``longspan/**/*.py`` file and in README.md and docs/*.md:
- a dotted ``longspan.x.y[.Name]`` path in the code must import (the resolution of ``test_public_paths``, which
  checks the docs' paths);
- a file name ``something.py`` meant to be in the repository must exist: ``longspan/...``, ``tests/...``,
  ``benchmarks/...`` or ``examples/...`` from the repository root; ``pkg/name.py`` whose first folder is a
  package folder of longspan (``training``, ``checkpointing``, ``utils``...) as the tail of a file under
  longspan/; a bare ``name.py`` as the name of some file of the repository.

Other projects' files are not checked: a relative or bare name on a line that names another project
(Megatron, Bridge, NeMo, Hugging Face, PyTorch) is read as that project's, and a path whose first folder is
not one of longspan's (``megatron/core/...``, ``tools/...``) is never longspan's.
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.code.test_public_paths import DOTTED, unresolved

REPO = Path(__file__).resolve().parents[2]
ROOT_FOLDERS = ("longspan", "tests", "benchmarks", "examples")

PY_FILE = re.compile(r"(?<![\w./-])((?:[\w-]+/)*\w+\.py)\b")
OTHER_PROJECT = re.compile(r"megatron|bridge|nemo|hugging ?face|\bhf\b|transformers|pytorch|torch\b", re.I)


def _repo_files() -> list[str]:
    files = []
    for folder in ROOT_FOLDERS + ("docs",):
        files += [p.relative_to(REPO).as_posix() for p in (REPO / folder).rglob("*") if p.is_file()]
    return files


REPO_FILES = _repo_files()
BASENAMES = {f.rsplit("/", 1)[-1] for f in REPO_FILES}
LONGSPAN_FILES = [f for f in REPO_FILES if f.startswith("longspan/")]
PACKAGE_FOLDERS = {part for f in LONGSPAN_FILES for part in f.split("/")[1:-1]}


def missing_file(ref: str, line: str) -> bool:
    """Whether ``ref`` (a ``.py`` name found on ``line``) names a longspan file that does not exist."""
    ref = ref.removeprefix("./")
    first = ref.split("/", 1)[0] if "/" in ref else None
    if first in ROOT_FOLDERS:
        return not (REPO / ref).is_file()
    if OTHER_PROJECT.search(line):
        return False
    if first is None:
        return ref not in BASENAMES
    if first not in PACKAGE_FOLDERS:
        return False
    return not any(f.endswith("/" + ref) for f in LONGSPAN_FILES)


def missing_files_in_text(text: str) -> list[str]:
    """``line: name`` for every ``.py`` name of ``text`` that ``missing_file`` rejects."""
    out = []
    for number, line in enumerate(text.splitlines(), start=1):
        out += [f"{number}: {ref}" for ref in PY_FILE.findall(line) if missing_file(ref, line)]
    return out


SOURCES = sorted(f for f in LONGSPAN_FILES if f.endswith(".py")) + ["README.md"] + sorted(
    f for f in REPO_FILES if f.startswith("docs/") and f.endswith(".md"))


def test_every_file_name_in_code_and_docs_exists() -> None:
    problems = []
    for source in SOURCES:
        text = (REPO / source).read_text(encoding="utf-8")
        problems += [f"{source}:{where}" for where in missing_files_in_text(text)]
    assert not problems, "names of files that do not exist:\n" + "\n".join(problems)


def test_every_longspan_path_in_code_imports() -> None:
    problems = []
    for source in SOURCES:
        if source.endswith(".py"):
            text = (REPO / source).read_text(encoding="utf-8")
            problems += [f"{source}: {m}" for m in unresolved(set(DOTTED.findall(text)))]
    assert not problems, "longspan paths that do not import:\n" + "\n".join(problems)


def test_the_scan_finds_a_missing_file_and_spares_other_projects() -> None:
    text = ("Loss checks live in ``training/precision.py`` and ``checkpoint_loading.py``;\n"
            "see longspan/training/no_such.py and tests/no_such_test.py.\n"
            "The layout ``save.py`` writes; ``resilience/rerun.py``; ``longspan/training/train.py``.\n"
            "As Megatron's tools/preprocess_data.py and megatron-core's rerun_state_machine.py.\n"
            "megatron/core/no_such.py is another project's;\n"
            "so is tools/no_such.py, whose first folder is none of longspan's.")
    assert missing_files_in_text(text) == [
        "1: training/precision.py", "1: checkpoint_loading.py", "2: longspan/training/no_such.py",
        "2: tests/no_such_test.py"]
