"""Which fields of a container were set on purpose, and by whom (the recipe, a YAML file, a dotlist override).

Values a pretrained checkpoint fills in (an HF ``config.json``, a longspan ``run_config.yaml`` under
``checkpoint.use_checkpoint_args``) must never silently replace a value the user chose, so the loading path
records what it sets: a recipe's fields that differ from the class defaults, every key a YAML file names and
every dotlist override (whatever its value: ``model.hidden_dropout=0.1`` is explicit even though 0.1 is the
default). Python code that edits a container after building it marks its choices with ``mark_explicit``.

The record lives on the container object (an attribute, not a field: it is not written to YAML); deep copies
carry it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

_ATTR = "_explicit_fields"
_META_KEYS = ("_target_", "_call_", "_partial_", "_args_", "_name_")

RECIPE_SOURCE_PREFIX = "recipe "


def _record(cfg: Any) -> dict[str, str]:
    record = cfg.__dict__.get(_ATTR)
    if record is None:
        record = {}
        cfg.__dict__[_ATTR] = record
    return record


def mark_explicit(cfg: Any, dotted: str, source: str = "override") -> None:
    """Record that ``dotted`` (``model.hidden_dropout``) was set on purpose by ``source``; later marks win."""
    _record(cfg)[dotted] = source


def explicit_fields(cfg: Any, section: str) -> dict[str, str]:
    """The explicitly set fields of ``section`` (their names, not dotted) -> who set them."""
    prefix = section + "."
    return {path[len(prefix):]: source for path, source in cfg.__dict__.get(_ATTR, {}).items()
            if path.startswith(prefix) and "." not in path[len(prefix):]}


def is_recipe_source(source: str) -> bool:
    return source.startswith(RECIPE_SOURCE_PREFIX)


def mark_mapping(cfg: Any, data: Any, source: str, prefix: str = "") -> None:
    """Mark every field a (YAML) mapping names, sections included down to their fields."""
    if not isinstance(data, dict):
        return
    for key, value in data.items():
        if key in _META_KEYS:
            continue
        path = f"{prefix}{key}"
        if isinstance(value, dict) and not prefix:
            mark_mapping(cfg, value, source, path + ".")
        else:
            mark_explicit(cfg, path, source)


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def mark_recipe_fields(cfg: Any, recipe_name: str) -> None:
    """Mark the fields a recipe set: those of each section that differ from their class default."""
    source = RECIPE_SOURCE_PREFIX + recipe_name
    for section in dataclasses.fields(cfg):
        obj = getattr(cfg, section.name)
        if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
            continue
        for f in dataclasses.fields(obj):
            default = _default(f)
            try:
                differs = default is dataclasses.MISSING or getattr(obj, f.name) != default
            except Exception:  # values without a usable == (tensors): count them as set
                differs = True
            if differs:
                mark_explicit(cfg, f"{section.name}.{f.name}", source)
