"""Slows down checkpoint writes in every process of a run that has this folder on its ``PYTHONPATH``.

Python imports ``sitecustomize`` at start-up, so the ``longspan`` launcher and every worker it spawns (fresh
interpreters) load this. Once ``longspan.training.checkpointing.async_save`` is imported, its writer class
becomes one that waits ``WRITE_DELAY_S`` seconds after writing this rank's shards and before the save completes:
the background writer of an async save stays in flight long enough for a test to kill a rank meanwhile. The
module is patched on import rather than imported here, so processes that never save (the launcher) never load
torch's checkpointing for it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import time
from types import ModuleType
from typing import Any, Optional, Sequence

WRITE_DELAY_S = 1.0
TARGET = "longspan.training.checkpointing.async_save"


def slow_down(module: ModuleType) -> None:
    """Replace ``module.FileSystemWriter`` (the writer its saves build) with one that waits after writing."""

    class SlowFileSystemWriter(module.FileSystemWriter):  # type: ignore[name-defined,misc]
        def write_data(self, plan: Any, planner: Any) -> Any:
            written = super().write_data(plan, planner)
            time.sleep(WRITE_DELAY_S)
            return written

    module.FileSystemWriter = SlowFileSystemWriter


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds ``TARGET`` with the other finders and runs ``slow_down`` on it right after it executes."""

    def find_spec(self, name: str, path: Optional[Sequence[str]], target: Any = None) -> Any:
        if name != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        execute = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            execute(module)
            slow_down(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if __name__ == "sitecustomize":  # at start-up only: a test importing WRITE_DELAY_S changes nothing in its process
    sys.meta_path.insert(0, _PatchOnImport())
