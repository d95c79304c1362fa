"""Dotlist overrides (``section.field=value``) and the one loading function the CLI uses."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import yaml

from longspan.config.serialize import LoadContext, apply_to_container, has_foreign_targets, load_yaml_file
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


def load_config(
    recipe: Optional[str] = None,
    config_files: Sequence[str] = (),
    overrides: Sequence[str] = (),
    allow_unknown: bool = False,
) -> Any:
    """Build the ConfigContainer of a run: recipe, then YAML files in order, then dotlist overrides.

    A YAML file may be a full config (``config show`` output, a Megatron Bridge run_config.yaml) or a
    partial override in Bridge's shape (only the sections and fields it names change). Without a recipe the
    first file must be a full config. Nothing is validated here (lazy validation); call ``cfg.validate()``.
    """
    from longspan.config.schema.container import ConfigContainer

    cfg: Optional[ConfigContainer] = None
    if recipe:
        from longspan.recipes import get_recipe

        cfg = get_recipe(recipe)
    for path in config_files or ():
        data = load_yaml_file(path)
        if data is None:
            raise ConfigError(f"config file {path!r} is empty")
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path!r}: the top level must be a mapping of sections")
        ctx = LoadContext(path, compat=has_foreign_targets(data), allow_unknown=allow_unknown)
        if cfg is None:
            cfg = ConfigContainer()
        apply_to_container(cfg, data, ctx)
        ctx.finish()
    if cfg is None:
        if overrides:
            raise ConfigError("overrides need a base config: give --recipe NAME or --config FILE")
        raise ConfigError("no configuration given: use --recipe NAME (e.g. tiny) and/or --config FILE")
    apply_overrides(cfg, overrides or ())
    return cfg
