"""Dotlist overrides (``section.field=value``, ``section.sub.field=value``), applied to a container in order.

A dotted path through a field that is None creates that section with its defaults first, as Hydra users
expect (``dataset.packed_sequence_specs.packed_sequence_size=256``, ``peft.dim=8`` with ``peft=null``). When
the field may hold several config classes, ``section._target_=CLASS`` must pick one first.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Sequence

import yaml

from longspan.config.explicit import mark_explicit
from longspan.config.serialize import LoadContext, apply_to_container, build_dataclass, merge_into
from longspan.config.targets import longspan_target, resolve_class
from longspan.config.types import field_types
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
    """Apply dotlist overrides in order (later ones win); each one is recorded as explicitly set."""
    for item in overrides:
        parts, value = parse_dotlist(item)
        ctx = LoadContext(f"override {item!r}")
        section = getattr(cfg, parts[0], None) if len(parts) > 1 else None
        if len(parts) > 1 and parts[0] == "mixed_precision" and isinstance(section, str):
            raise ConfigError(
                f"override {item!r}: mixed_precision is the recipe name {section!r}; set mixed_precision=NAME instead"
            )
        if len(parts) <= 2:
            apply_to_container(cfg, dotlist_to_dict(parts, value), ctx)
        else:
            _apply_nested(cfg, parts, value, item, ctx)
        mark_explicit(cfg, ".".join(parts[:-1] if parts[-1] == "_target_" else parts))


def _apply_nested(cfg: Any, parts: list[str], value: Any, item: str, ctx: LoadContext) -> None:
    """``section.sub[.sub...].field=value``: walk (creating None sections) and set the last field."""
    if getattr(cfg, parts[0], None) is None:
        apply_to_container(cfg, {parts[0]: {}}, ctx)  # the section's default class, with its defaults
    obj = getattr(cfg, parts[0])
    if parts[-1] == "_target_":
        parent = _walk(obj, parts[:-2], item, ctx)
        _set_section_class(parent, parts[-2], value, ".".join(parts[:-1]), item, ctx)
        return
    obj = _walk(obj, parts[:-1], item, ctx)
    if isinstance(obj, dict):
        obj[parts[-1]] = value
    else:
        merge_into(obj, {parts[-1]: value}, ".".join(parts[:-1]), ctx)


def _walk(obj: Any, parts: list[str], item: str, ctx: LoadContext) -> Any:
    """The object at ``parts[1:]`` below ``obj`` (the section ``parts[0]``), creating sections that are None."""
    for depth in range(1, len(parts)):
        obj = _child_section(obj, parts[depth], ".".join(parts[:depth + 1]), item, ctx)
    return obj


def _child_section(obj: Any, name: str, path: str, item: str, ctx: LoadContext) -> Any:
    if isinstance(obj, dict):
        child = obj.get(name)
        if child is None:
            child = obj[name] = {}
        elif not isinstance(child, dict) and not _is_config_object(child):
            raise ConfigError(f"override {item!r}: {path}={child!r} is a value, not a section")
        return child
    known = {f.name for f in dataclasses.fields(obj)}
    if name not in known:
        parent = path.rpartition(".")[0]
        ctx.unknown_key(parent, name, None, sorted(known))
    child = getattr(obj, name)
    if child is None:
        child = _new_section(field_types(type(obj))[name], path, item)
        setattr(obj, name, child)
    elif not isinstance(child, dict) and not _is_config_object(child):
        raise ConfigError(f"override {item!r}: {path} is a field, not a section")
    return child


def _is_config_object(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def _new_section(tp: Any, path: str, item: str) -> Any:
    """A section with its defaults for a None field typed ``Optional[Config]`` or a mapping."""
    arms = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    classes = [a for a in arms if isinstance(a, type) and dataclasses.is_dataclass(a)]
    if len(classes) > 1:
        names = " or ".join(_target_name(c) for c in classes)
        raise ConfigError(f"override {item!r}: {path} is None and may hold {names}: "
                          f"set {path}._target_=CLASS first")
    if classes:
        try:
            return classes[0]()
        except TypeError:
            raise ConfigError(f"override {item!r}: {path} ({classes[0].__name__}) has required fields: "
                              f"set it as a whole ({path}={{...}})") from None
    if any(a is dict or typing.get_origin(a) is dict for a in arms):
        return {}
    raise ConfigError(f"override {item!r}: {path} is a field, not a section")


def _target_name(cls: type) -> str:
    try:
        return longspan_target(cls)
    except ConfigError:  # not one of longspan's config classes: its import path
        return f"{cls.__module__}.{cls.__qualname__}"


def _set_section_class(parent: Any, name: str, target: Any, path: str, item: str, ctx: LoadContext) -> None:
    """``section.sub._target_=CLASS``: make ``sub`` that class (with its defaults) unless it already is."""
    cls = resolve_class(target, path) if isinstance(target, str) else None
    if cls is None:
        raise ConfigError(f"override {item!r}: {path}._target_ {target!r} is not an allowed config class")
    current = parent.get(name) if isinstance(parent, dict) else getattr(parent, name)
    if type(current) is cls:
        return
    new = build_dataclass(cls, {}, path, ctx)
    if isinstance(parent, dict):
        parent[name] = new
    else:
        setattr(parent, name, new)
