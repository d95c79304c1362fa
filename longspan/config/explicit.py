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
# A section a YAML file writes whole (with its ``_target_``: ``config show`` output, a Bridge run_config.yaml)
# cannot say which values were edited: like a recipe, it marks the fields that differ from the class defaults.
WHOLE_SECTION_SUFFIX = " (whole section)"


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
    """Whether ``source`` is a template (a recipe, or a section a file writes whole) rather than a choice of one
    field: a pretrained checkpoint's architecture replaces a template's."""
    return source.startswith(RECIPE_SOURCE_PREFIX) or source.endswith(WHOLE_SECTION_SUFFIX)


def mark_mapping(cfg: Any, data: Any, source: str, prefix: str = "") -> None:
    """Mark every field a (YAML) mapping names; a section written whole (with ``_target_``) marks, as a
    template, the fields that differ from its class defaults."""
    if not isinstance(data, dict):
        return
    for key, value in data.items():
        if key in _META_KEYS:
            continue
        path = f"{prefix}{key}"
        if isinstance(value, dict) and not prefix and "_target_" in value:
            section = getattr(cfg, key, None)
            if dataclasses.is_dataclass(section) and not isinstance(section, type):
                _mark_non_defaults(cfg, key, section, source + WHOLE_SECTION_SUFFIX)
        elif isinstance(value, dict) and not prefix:
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
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            _mark_non_defaults(cfg, section.name, obj, source)


def _mark_non_defaults(cfg: Any, section: str, obj: Any, source: str) -> None:
    for f in dataclasses.fields(obj):
        default = _default(f)
        try:
            differs = default is dataclasses.MISSING or getattr(obj, f.name) != default
        except Exception:  # values without a usable == (tensors): count them as set
            differs = True
        if differs:
            mark_explicit(cfg, f"{section}.{f.name}", source)
            value = getattr(obj, f.name)
            if isinstance(value, (str, int, float, bool)):  # immutable: later code may change the field, not this
                cfg.__dict__.setdefault(_TEMPLATE_ATTR, {})[f"{section}.{f.name}"] = value


_TEMPLATE_ATTR = "_template_values"


def is_template_value(cfg: Any, dotted: str, value: Any) -> bool:
    """Whether ``dotted`` still holds what a template (a recipe, a section a file writes whole) gave it: no choice
    of the user's has marked it since, and no code has changed its value."""
    source = cfg.__dict__.get(_ATTR, {}).get(dotted)
    if source is None or not is_recipe_source(source):
        return False
    templates = cfg.__dict__.get(_TEMPLATE_ATTR, {})
    return dotted in templates and templates[dotted] == value


def template_value(cfg: Any, dotted: str) -> Any:
    """The value a template gave ``dotted`` (None when none did)."""
    return cfg.__dict__.get(_TEMPLATE_ATTR, {}).get(dotted)


_FAMILY_ATTR = "_model_family"


def mark_model_family(cfg: Any, family: str) -> None:
    """Record the HF family (``conversion.families.Family.name``) the container's model is built as: a family
    recipe's or an imported model's. Like the explicit fields, an attribute (not written to YAML; checkpoints
    keep it beside run_config.yaml)."""
    cfg.__dict__[_FAMILY_ATTR] = family


def model_family(cfg: Any) -> str | None:
    """The family ``mark_model_family`` recorded, or None."""
    return cfg.__dict__.get(_FAMILY_ATTR)
