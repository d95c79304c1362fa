"""Every longspan import path the docs name exists.

The paths are read from the docs themselves when the test runs, so a doc that names a module, class or function
that moved or never existed fails here:
- README.md and docs/*.md: every dotted ``longspan.x.y[.Name]``, ``from longspan.x import a, b`` and
  ``longspan.x.A / B`` (siblings of the last component);
- the project's map beside the repository (ARCHITECTURE.md) the same way;
- the spec pages (seeds/*.txt): Megatron Bridge's ``bridge.training.<module>[.Name]`` for the modules longspan
  keeps under Bridge's path (``longspan.training.<module>``), plus Bridge's entry points that the pages do not
  spell out (pretrain, finetune, save_checkpoint, load_checkpoint, evaluate, forward_step).
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]

# The spec and the project map live beside the repository (CI checks them out there); a worktree sits one
# folder deeper. Their tests skip only when neither place has them (a clone on its own).
SHARED = next((p for p in (REPO.parent / "shared", REPO.parent.parent / "shared") if p.is_dir()), None)

DOTTED = re.compile(r"\blongspan(?:\.[A-Za-z_]\w*)+")
SIBLINGS = re.compile(r"\b(longspan(?:\.[A-Za-z_]\w*)+)((?:\s*/\s*[A-Z]\w*)+)")
FROM_IMPORT = re.compile(r"\bfrom (longspan(?:\.\w+)*) import ([\w ,]+)")

# Megatron Bridge modules longspan implements under the same path (bridge.training.X -> longspan.training.X).
BRIDGE_MODULES = ("config", "train", "state", "utils.train_utils", "pretrain", "finetune", "forward_step",
                  "profiling", "checkpointing", "eval")
BRIDGE_SEED_PATH = re.compile(
    r"\b(?:megatron\.)?bridge\.training\.(" + "|".join(re.escape(m) for m in BRIDGE_MODULES) + r")((?:\.\w+)*)")
BRIDGE_ENTRY_POINTS = (
    "longspan.training.pretrain.pretrain",
    "longspan.training.finetune.finetune",
    "longspan.training.checkpointing.save_checkpoint",
    "longspan.training.checkpointing.load_checkpoint",
    "longspan.training.eval.evaluate",
    "longspan.training.eval.evaluate_and_print_results",
    "longspan.training.forward_step.forward_step",
    "longspan.training.profiling",
)


def paths_in_text(text: str) -> set[str]:
    """Every longspan path the text names: dotted paths, ``from ... import`` lists and ``A / B`` siblings."""
    found = set(DOTTED.findall(text))
    for module, names in FROM_IMPORT.findall(text):
        found.update(f"{module}.{name.strip()}" for name in names.split(",") if name.strip())
    for first, rest in SIBLINGS.findall(text):
        parent = first.rsplit(".", 1)[0]
        found.update(f"{parent}.{name.strip()}" for name in rest.split("/") if name.strip())
    return found


def bridge_paths_in_text(text: str) -> set[str]:
    """Bridge's ``bridge.training.<module>[.name]`` paths of the modules longspan keeps, as longspan paths."""
    return {f"longspan.training.{module}{rest}" for module, rest in BRIDGE_SEED_PATH.findall(text)}


def resolve(path: str) -> Any:
    """The object a dotted path names: submodules imported as needed, then attributes."""
    parts = path.split(".")
    obj: Any = importlib.import_module(parts[0])
    for i in range(1, len(parts)):
        name = ".".join(parts[: i + 1])
        if isinstance(obj, ModuleType) and hasattr(obj, "__path__") and importlib.util.find_spec(name) is not None:
            obj = importlib.import_module(name)
        elif hasattr(obj, parts[i]):
            obj = getattr(obj, parts[i])
        else:
            raise LookupError(f"{'.'.join(parts[:i])} has no {parts[i]!r}")
    return obj


def unresolved(paths: set[str]) -> list[str]:
    missing = []
    for path in sorted(paths):
        try:
            resolve(path)
        except (ImportError, LookupError) as exc:
            missing.append(f"{path}: {exc}")
    return missing


def _shared(relative: str) -> Path:
    if SHARED is None:
        pytest.skip("../shared is absent (the spec and the project map live beside the repository, not in it)")
    path = SHARED / relative
    assert path.exists(), f"{path} not found"
    return path


DOCS = ["README.md"] + sorted(p.relative_to(REPO).as_posix() for p in (REPO / "docs").glob("*.md"))


@pytest.mark.parametrize("doc", DOCS)
def test_every_longspan_path_a_doc_names_imports(doc: str) -> None:
    paths = paths_in_text((REPO / doc).read_text(encoding="utf-8"))
    missing = unresolved(paths)
    assert not missing, f"{doc} names paths that do not import:\n" + "\n".join(missing)


def test_every_longspan_path_the_architecture_map_names_imports() -> None:
    text = _shared("ARCHITECTURE.md").read_text(encoding="utf-8")
    paths = paths_in_text(text)
    assert len(paths) >= 10, sorted(paths)
    missing = unresolved(paths)
    assert not missing, "ARCHITECTURE.md names paths that do not import:\n" + "\n".join(missing)


def test_bridge_paths_of_the_spec_import_from_longspan() -> None:
    seeds = sorted(_shared("seeds").glob("*.txt"))
    assert seeds
    paths = set(BRIDGE_ENTRY_POINTS)
    for seed in seeds:
        paths |= bridge_paths_in_text(seed.read_text(encoding="utf-8"))
    assert {"longspan.training.config.ConfigContainer", "longspan.training.state.GlobalState",
            "longspan.training.train.train_step", "longspan.training.utils.train_utils.training_log"} <= paths
    missing = unresolved(paths)
    assert not missing, "Megatron Bridge paths of the spec that longspan lacks:\n" + "\n".join(missing)


def test_the_extraction_reads_every_form_and_a_wrong_path_fails() -> None:
    text = ("Use `longspan.training.pretrain.pretrain`; `longspan.data.gpt_dataset.GPTDataset /\n  MockGPTDataset`.\n"
            "from longspan.recipes import get_recipe, tiny\n"
            "See ``longspan.training.precision`` (moved).")
    assert paths_in_text(text) == {
        "longspan.training.pretrain.pretrain", "longspan.data.gpt_dataset.GPTDataset",
        "longspan.data.gpt_dataset.MockGPTDataset", "longspan.recipes", "longspan.recipes.get_recipe",
        "longspan.recipes.tiny", "longspan.training.precision"}
    assert [m.split(":")[0] for m in unresolved(paths_in_text(text))] == ["longspan.training.precision"]
    assert unresolved({"longspan.training.pretrain.no_such_function"})
    assert bridge_paths_in_text("- megatron.bridge.training.state.GlobalState and bridge.training.gpt_step.x") == {
        "longspan.training.state.GlobalState"}
