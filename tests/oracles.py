"""Reference implementations (megatron-core, transformers) as test oracles.

``oracle("megatron.core.datasets.gpt_dataset")`` imports the module when a test first uses it, with a plain
import: tests that need the oracle fail loudly when it is missing (CI installs it), while the module's
oracle-free tests still run. Never skip on a missing oracle.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any


class oracle:  # noqa: N801 - reads as a function at the use site
    """A module imported on first attribute access."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._module: ModuleType | None = None

    def __getattr__(self, attr: str) -> Any:
        if self._module is None:
            self._module = importlib.import_module(self._name)
        return getattr(self._module, attr)
