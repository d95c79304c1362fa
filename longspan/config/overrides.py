"""Dotlist overrides (``section.field=value``), applied to a container in order."""

from __future__ import annotations

from typing import Any, Sequence

import yaml

from longspan.config.serialize import LoadContext, apply_to_container
from longspan.core.errors import ConfigError


def parse_dotlist(item: str) -> tuple[list[str], Any]:
    """'train.train_iters=100' -> (['train', 'train_iters'], 100); the value is read as a YAML scalar/list."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not of the form section.field=value")
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    if not key.strip() or any(not p or not p.replace("_", "a").isalnum() for p in parts):
        raise ConfigError(f"override {item!r}: {key!r} is not a dotted field name like train.train_iters")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        raise ConfigError(f"override {item!r}: the value {raw!r} is not valid YAML") from None
    return parts, value


def dotlist_to_dict(parts: list[str], value: Any) -> dict[str, Any]:
    """['a', 'b'], 1 -> {'a': {'b': 1}}."""
    out: Any = value
    for part in reversed(parts):
        out = {part: out}
    return out


def apply_overrides(cfg: Any, overrides: Sequence[str]) -> None:
    """Apply dotlist overrides in order (later ones win)."""
    for item in overrides:
        parts, value = parse_dotlist(item)
        if len(parts) > 2 and parts[0] != "mixed_precision":
            raise ConfigError(f"override {item!r}: {'.'.join(parts[:2])} is a field, not a section")
        ctx = LoadContext(f"override {item!r}")
        section = getattr(cfg, parts[0], None) if len(parts) > 1 else None
        if len(parts) > 1 and parts[0] == "mixed_precision" and isinstance(section, str):
            raise ConfigError(
                f"override {item!r}: mixed_precision is the recipe name {section!r}; set mixed_precision=NAME instead"
            )
        apply_to_container(cfg, dotlist_to_dict(parts, value), ctx)
