"""The one loading function the commands use: a recipe, then YAML files, then dotlist overrides."""

from __future__ import annotations

from typing import Optional, Sequence

from longspan.config.explicit import mark_mapping
from longspan.config.overrides import apply_overrides
from longspan.config.schema.container import ConfigContainer
from longspan.config.serialize import LoadContext, apply_to_container, has_foreign_targets, load_yaml_file
from longspan.core.errors import ConfigError
from longspan.recipes import get_recipe


def load_config(
    recipe: Optional[str] = None,
    config_files: Sequence[str] = (),
    overrides: Sequence[str] = (),
    allow_unknown: bool = False,
) -> ConfigContainer:
    """Build the ConfigContainer of a run: recipe, then YAML files in order, then dotlist overrides.

    A YAML file may be a full config (``config show`` output, a Megatron Bridge run_config.yaml) or a
    partial override in Bridge's shape (only the sections and fields it names change). Without a recipe the
    first file must be a full config. Nothing is validated here (lazy validation); call ``cfg.validate()``.
    """
    cfg: Optional[ConfigContainer] = None
    if recipe:
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
        mark_mapping(cfg, data, f"config file {path}")
    if cfg is None:
        if overrides:
            raise ConfigError("overrides need a base config: give --recipe NAME or --config FILE")
        raise ConfigError("no configuration given: use --recipe NAME (e.g. tiny) and/or --config FILE")
    apply_overrides(cfg, overrides or ())
    return cfg
