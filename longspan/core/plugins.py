"""The one place lower layers reach the model families: a loader the package root installs.

Registries live in the layer that uses them (``config.targets`` for config classes,
``conversion.families`` for HF architectures, ``recipes`` for recipes, ...). The family packages
(``longspan.families``) sit above all of them and register their pieces when imported. A lookup in a registry
calls ``load_plugins()`` first; the loader itself is installed by the composition root (``longspan/__init__.py``),
so no module below ``longspan.families`` imports it, by name or by string.
"""

from __future__ import annotations

from typing import Callable

_loader: Callable[[], None] | None = None
_loaded = False


def set_loader(loader: Callable[[], None]) -> None:
    """Install the function that imports every registering package (called once, by the package root)."""
    global _loader
    _loader = loader


def load_plugins() -> None:
    """Import the registering packages once (a no-op after the first call, or while they are being imported)."""
    global _loaded
    if _loaded or _loader is None:
        return
    _loaded = True
    try:
        _loader()
    except BaseException:
        _loaded = False  # a failed import leaves the registries partial: the next lookup tries again
        raise
