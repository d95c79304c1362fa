"""YAML <-> ConfigContainer, safely.

Files are read with ``yaml.safe_load`` only (no Python tags) and every ``_target_`` goes through the allowlist
in ``targets.py``. longspan's own files are strict: an unknown key is an error naming the closest valid keys.
A file with Megatron Bridge / Megatron Core targets (a Bridge ``run_config.yaml``) loads in compatibility
mode: known fields map onto longspan's, unknown ones are collected and reported in one message.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import os
import types
import typing
from typing import Any, Optional

import torch
import yaml

from longspan.config.targets import (
    callable_name,
    config_class,
    dtype_name,
    is_foreign_target,
    longspan_target,
    resolve_class,
    resolve_value_target,
    section_type_names,
)
from longspan.config.types import coerce_value, field_types, float_only, is_derived_field, yaml_fields
from longspan.core.errors import ConfigError
from longspan.core.logging import get_logger, warn_rank_0

_log = get_logger(__name__)

_META_KEYS = ("_target_", "_call_", "_partial_", "_args_", "_name_")

# Values Megatron derives at runtime and writes into run_config.yaml; longspan rebuilds them, so a Bridge
# file's copies are dropped silently.
_BRIDGE_DERIVED = {
    "model.init_method", "model.output_layer_init_method", "model.embedding_init_method",
    "model.transformer_layer_spec", "model.generation_config", "model.timers", "model.finalize_model_grads_func",
    "model.grad_scale_func", "model.no_sync_func", "model.grad_sync_func", "model.param_sync_func",
    "optimizer.timers", "dataset.tokenizer", "dataset.split_matrix", "model.hf_model_id",
}


# ---------------------------------------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------------------------------------
def _plain(value: Any, where: str) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _dataclass_to_dict(value, where)
    if isinstance(value, torch.dtype):
        return {"_target_": dtype_name(value), "_call_": False}
    if isinstance(value, bool) or value is None or isinstance(value, (str, float)):
        return value
    if isinstance(value, enum.Enum):
        return value.value if isinstance(value, int) else value.name
    if isinstance(value, int):
        return int(value)  # signal.Signals is an IntEnum: write the number
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {str(k): _plain(v, f"{where}.{k}") for k, v in value.items()}
    if callable(value):
        return {"_target_": callable_name(value, where), "_call_": False}
    raise ConfigError(f"{where}={value!r} cannot be written to YAML")


def _dataclass_to_dict(obj: Any, where: str) -> dict[str, Any]:
    out: dict[str, Any] = {"_target_": longspan_target(type(obj))}
    hints = field_types(type(obj))
    for f in yaml_fields(obj):
        if is_derived_field(f):
            continue
        value = getattr(obj, f.name)
        if float_only(hints[f.name]) and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)  # write floats as floats, so the file reads back to the same text
        out[f.name] = _plain(value, f"{where}.{f.name}")
    return out


def to_dict(cfg: Any) -> dict[str, Any]:
    """A ConfigContainer (or any longspan config dataclass) as plain data with ``_target_`` keys."""
    out: dict[str, Any] = {"_target_": longspan_target(type(cfg))}
    for f in dataclasses.fields(cfg):
        out[f.name] = _plain(getattr(cfg, f.name), f.name)
    return out


def dump_yaml(cfg: Any) -> str:
    """Deterministic YAML text of ``cfg`` (loads back to an equal container)."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=False, allow_unicode=True)


# ---------------------------------------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------------------------------------
def load_yaml_file(path: str) -> Any:
    """Parse a YAML file with the safe loader; problems become one-line ConfigErrors naming the file."""
    if not os.path.exists(path):
        raise ConfigError(f"config file {path!r} does not exist")
    if os.path.isdir(path):
        raise ConfigError(f"config file {path!r} is a directory, not a YAML file")
    try:
        with open(path, encoding="utf-8") as fh:
            return yaml.safe_load(fh)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"config file {path!r}{where}: not valid YAML ({problem}); python tags are never loaded") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path!r} cannot be read: {exc}") from None


class LoadContext:
    """Where values come from and what to do with keys longspan does not know."""

    def __init__(self, source: str, compat: bool = False, allow_unknown: bool = False) -> None:
        self.source = source
        self.compat = compat
        self.allow_unknown = allow_unknown
        self.unknown: list[tuple[str, Any]] = []

    def unknown_key(self, path: str, key: str, value: Any, valid: list[str]) -> None:
        full = f"{path}.{key}" if path else key
        if full in _BRIDGE_DERIVED:
            return
        if self.compat:
            self.unknown.append((full, value))
            return
        close = difflib.get_close_matches(key, valid, n=3, cutoff=0.6)
        hint = f"did you mean {' or '.join(close)}?" if close else "see docs/config-support.md for the valid keys"
        raise ConfigError(f"{self.source}: unknown key '{full}': {hint}")

    def finish(self) -> None:
        """Report the unknown keys of a Megatron Bridge file in one message."""
        if not self.unknown:
            return
        set_ = [(p, v) for p, v in self.unknown if _is_set(v)]
        if set_ and not self.allow_unknown:
            listed = ", ".join(f"{p}={_short(v)}" for p, v in set_[:12])
            more = f" (+{len(set_) - 12} more)" if len(set_) > 12 else ""
            raise ConfigError(
                f"{self.source}: {len(set_)} Megatron Bridge fields that longspan does not know are set: "
                f"{listed}{more}; pass --allow-unknown to ignore them"
            )
        warn_rank_0(
            f"{self.source}: ignoring {len(self.unknown)} Megatron Bridge fields longspan does not know: "
            + ", ".join(p for p, _ in self.unknown),
            _log,
        )


def _is_set(value: Any) -> bool:
    """A heuristic 'non-default' for fields we know nothing about: anything but null/false/0/empty."""
    if isinstance(value, dict):
        return any(_is_set(v) for k, v in value.items() if k not in _META_KEYS)
    if isinstance(value, list):
        return any(_is_set(v) for v in value)
    return bool(value)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def has_foreign_targets(data: Any) -> bool:
    """True when any ``_target_`` in ``data`` names a Megatron class (a Bridge run_config.yaml)."""
    if isinstance(data, dict):
        target = data.get("_target_")
        if isinstance(target, str) and is_foreign_target(target):
            return True
        return any(has_foreign_targets(v) for v in data.values())
    if isinstance(data, list):
        return any(has_foreign_targets(v) for v in data)
    return False


def _convert(value: Any, tp: Any, path: str, ctx: LoadContext) -> Any:
    if isinstance(value, dict) and "_target_" in value:
        target = value["_target_"]
        if not isinstance(target, str):
            raise ConfigError(f"{ctx.source}: {path}._target_ must be a string")
        cls = resolve_class(target, path)
        if cls is not None:
            return build_dataclass(cls, value, path, ctx)
        if "_name_" in value and not isinstance(value.get("_name_"), dict) and ctx.compat:
            return coerce_value(value["_name_"], tp, path)  # a Bridge enum such as AttnBackend.auto
        try:
            resolve_value_target(target, path)
        except ConfigError:
            if ctx.compat and is_foreign_target(target):
                raise _Unknown() from None
            raise ConfigError(f"{ctx.source}: {path}: _target_ {target!r} is not allowed") from None
    nested = _nested_config(value, tp, path, ctx)
    return nested if nested is not None else coerce_value(value, tp, path)


def _nested_config(value: Any, tp: Any, path: str, ctx: LoadContext) -> Any:
    """A field typed as a config dataclass (or a list of them) built from a mapping (or a list); else None."""
    arms = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    if isinstance(value, dict):
        for arm in arms:
            if dataclasses.is_dataclass(arm):
                return build_dataclass(arm, value, path, ctx)
    if isinstance(value, list):
        for arm in arms:
            inner = typing.get_args(arm) if typing.get_origin(arm) is list else ()
            if inner and dataclasses.is_dataclass(inner[0]):
                return [_convert(v, inner[0], f"{path}[{i}]", ctx) for i, v in enumerate(value)]
    return None


class _Unknown(Exception):
    """A Bridge value longspan cannot represent; the field is reported with the unknown keys."""


def _section_values(cls: type, data: dict[str, Any], path: str, ctx: LoadContext) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise ConfigError(f"{ctx.source}: {path} must be a mapping of fields, got {data!r}")
    hints = field_types(cls)
    known = {f.name: f for f in dataclasses.fields(cls)}
    valid = [f.name for f in yaml_fields(cls)]
    values: dict[str, Any] = {}
    for key, raw in data.items():
        if key in _META_KEYS:
            continue
        f = known.get(key)
        if f is None or (f.metadata.get("yaml", True) is False and not is_derived_field(f)):
            if f is not None and raw is None:
                continue  # a runtime field written as null
            ctx.unknown_key(path, str(key), raw, valid)
            continue
        if is_derived_field(f):
            continue  # recomputed by validate()
        try:
            values[key] = _convert(raw, hints[key], f"{path}.{key}", ctx)
        except _Unknown:
            ctx.unknown.append((f"{path}.{key}", raw))
    return values


def build_dataclass(cls: type, data: dict[str, Any], path: str, ctx: LoadContext) -> Any:
    """Construct ``cls`` from a mapping of its fields (checked and converted)."""
    values = _section_values(cls, data, path, ctx)
    init = {k: v for k, v in values.items() if next(f for f in dataclasses.fields(cls) if f.name == k).init}
    try:
        obj = cls(**init)
    except TypeError as exc:
        missing = [f.name for f in dataclasses.fields(cls)
                   if f.init and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
                   and f.name not in init]
        detail = f"missing required field(s) {', '.join(missing)}" if missing else str(exc)
        raise ConfigError(f"{ctx.source}: {path} ({cls.__name__}): {detail}") from None
    for key, value in values.items():
        if key not in init:
            setattr(obj, key, value)
    return obj


def merge_into(obj: Any, data: dict[str, Any], path: str, ctx: LoadContext) -> None:
    """Set the fields named in ``data`` on an existing config object (a partial override)."""
    for key, value in _section_values(type(obj), data, path, ctx).items():
        setattr(obj, key, value)


def _default_section_class(name: str) -> Optional[type]:
    names = section_type_names(name)
    return config_class(names[0]) if names else None


def apply_to_container(cfg: Any, data: dict[str, Any], ctx: LoadContext) -> None:
    """Apply a (full or partial) container mapping to ``cfg``: named sections/fields change, the rest stays."""
    if not isinstance(data, dict):
        raise ConfigError(f"{ctx.source}: the top level must be a mapping of sections, got {type(data).__name__}")
    target = data.get("_target_")
    if target is not None and (not isinstance(target, str) or (
            resolve_class(target, "_target_") is not type(cfg)
            and not target.endswith(".ConfigContainer"))):
        raise ConfigError(f"{ctx.source}: top-level _target_ {target!r} is not allowed (expected a ConfigContainer)")
    sections = {f.name: f for f in dataclasses.fields(cfg)}
    for key, value in data.items():
        if key in _META_KEYS:
            continue
        if key not in sections:
            ctx.unknown_key("", str(key), value, list(sections))
            continue
        current = getattr(cfg, key)
        if value is None:
            setattr(cfg, key, None)
        elif key == "comm_overlap":
            setattr(cfg, key, value)  # kept as data; validate() reports it as not supported yet
        elif key == "mixed_precision" and isinstance(value, str):
            setattr(cfg, key, value)
        elif isinstance(value, dict):
            new_target = value.get("_target_")
            new_cls = resolve_class(new_target, key) if isinstance(new_target, str) else None
            if isinstance(new_target, str) and new_cls is None:
                if ctx.compat and is_foreign_target(new_target):
                    ctx.unknown.append((key, value))
                    continue
                raise ConfigError(f"{ctx.source}: {key}: _target_ {new_target!r} is not allowed")
            if current is not None and dataclasses.is_dataclass(current) and (new_cls in (None, type(current))):
                merge_into(current, value, key, ctx)
            else:
                cls = new_cls or _default_section_class(key)
                if cls is None and key == "mixed_precision":
                    cls = config_class("MixedPrecisionConfig")
                if cls is None:
                    raise ConfigError(f"{ctx.source}: {key} cannot be built from a mapping")
                setattr(cfg, key, build_dataclass(cls, value, key, ctx))
        else:
            raise ConfigError(
                f"{ctx.source}: {key}={_short(value)} has the wrong type: expected a mapping of fields"
                + (" or a recipe name" if key == "mixed_precision" else "")
            )


def container_from_dict(data: Any, allow_unknown: bool = False, source: str = "<dict>") -> Any:
    """A new ConfigContainer from a full mapping (``to_dict`` output, a longspan YAML or a Bridge run_config)."""
    ConfigContainer = config_class("ConfigContainer")  # noqa: N806 - the container module imports this one

    if data is None:
        raise ConfigError(f"{source}: the file is empty")
    cfg = ConfigContainer()
    ctx = LoadContext(source, compat=has_foreign_targets(data), allow_unknown=allow_unknown)
    apply_to_container(cfg, data, ctx)
    ctx.finish()
    return cfg
