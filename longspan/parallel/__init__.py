"""Turn a plain model into a distributed one: process groups and device mesh, launch, collectives, and the
plans applied from outside the model (DDP/FSDP2, tensor/sequence parallel, pipeline stages, context parallel,
expert parallel, compile, float8).

May import: core, config, models, data.

Submodules (imported lazily, so ``import longspan.parallel`` costs nothing on one process):
- ``longspan.parallel.init``: ``initialize_distributed``, ``ParallelState``, ``detect_launch``,
  ``get_parallel_state``, ``destroy_distributed``, ``report_user_error_once``.
- ``longspan.parallel.mesh``: ``build_device_mesh``, ``check_layout``, ``derive_layout``, ``Layout``.
- ``longspan.parallel.collectives``: no-op-on-one-process helpers (all_reduce_max/sum, logical_and, ...).
- ``longspan.parallel.launcher``: ``launch`` (torch elastic in-process, one-line failure reports).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "initialize_distributed": "longspan.parallel.init",
    "ParallelState": "longspan.parallel.init",
    "get_parallel_state": "longspan.parallel.init",
    "destroy_distributed": "longspan.parallel.init",
    "detect_launch": "longspan.parallel.init",
    "report_user_error_once": "longspan.parallel.init",
    "build_device_mesh": "longspan.parallel.mesh",
    "check_layout": "longspan.parallel.mesh",
    "derive_layout": "longspan.parallel.mesh",
    "Layout": "longspan.parallel.mesh",
    "launch": "longspan.parallel.launcher",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'longspan.parallel' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
