"""Type checks and conversions of config values against the dataclass annotations.

``check_value`` is strict (used by ``validate()`` on programmatic configs); ``coerce_value`` also accepts the
spellings a YAML file or a dotlist produces ('3e-4' for a float, 'bf16' for a dtype, 'silu' for a function).
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any, Literal, Union

import torch

from longspan.config.targets import parse_callable, parse_dtype
from longspan.core.errors import ConfigError

_NONE = type(None)


@functools.lru_cache(maxsize=None)
def field_types(cls: type) -> dict[str, Any]:
    """Resolved annotations of a dataclass's fields."""
    return typing.get_type_hints(cls)


def is_runtime_field(f: dataclasses.Field) -> bool:
    """Fields that are never read from or written to YAML (runtime objects, derived values, private)."""
    return f.name.startswith("_") or f.metadata.get("yaml", True) is False


def is_derived_field(f: dataclasses.Field) -> bool:
    """Fields computed by validate() (e.g. scheduler.lr_warmup_steps)."""
    return bool(f.metadata.get("derived"))


def yaml_fields(obj_or_cls: Any) -> list[dataclasses.Field]:
    """The dataclass fields that belong in YAML, in declaration order."""
    return [f for f in dataclasses.fields(obj_or_cls) if not is_runtime_field(f)]


def _args(tp: Any) -> tuple:
    return typing.get_args(tp)


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType)


def describe(tp: Any) -> str:
    """A short human-readable name of an annotation ('int or null', 'one of ...')."""
    if tp is Any:
        return "any value"
    if tp is _NONE:
        return "null"
    if _is_union(tp):
        return " or ".join(describe(a) for a in _args(tp))
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in _args(tp))
    if origin in (list, tuple):
        inner = _args(tp)
        return f"a list of {describe(inner[0])}" if inner else "a list"
    if origin is dict or tp is dict:
        return "a mapping"
    if tp is torch.dtype:
        return "a dtype (float32, bfloat16, float16)"
    if tp is typing.Callable or origin is typing.Callable or str(tp).startswith("typing.Callable"):
        return "a function"
    return getattr(tp, "__name__", str(tp))


def check_value(value: Any, tp: Any) -> bool:
    """True when ``value`` fits annotation ``tp`` (bools are not ints, ints are floats)."""
    if tp is Any:
        return True
    if tp is _NONE:
        return value is None
    if _is_union(tp):
        return any(check_value(value, a) for a in _args(tp))
    origin = typing.get_origin(tp)
    if origin is Literal:
        return any(value == a and type(value) is type(a) for a in _args(tp))
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    if tp is torch.dtype:
        return isinstance(value, torch.dtype)
    if origin in (list, tuple) or tp in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return False
        inner = _args(tp)
        return not inner or inner[0] is Any or all(check_value(v, inner[0]) for v in value)
    if origin is dict or tp is dict:
        return isinstance(value, dict)
    if origin is not None and str(origin).endswith("Callable'>") or tp is typing.Callable:
        return callable(value)
    if origin is typing.ContextManager or str(tp).startswith("typing.ContextManager"):
        return True
    if isinstance(tp, type):
        return isinstance(value, tp)
    return True


def _error(path: str, value: Any, tp: Any) -> ConfigError:
    if typing.get_origin(tp) is Literal or (
        _is_union(tp) and any(typing.get_origin(a) is Literal for a in _args(tp))
    ):
        return ConfigError(f"{path}={value!r} is not valid: choose {describe(tp)}")
    return ConfigError(f"{path}={value!r} has the wrong type: expected {describe(tp)}")


def _mentions(tp: Any, target: Any) -> bool:
    if tp is target:
        return True
    if _is_union(tp):
        return any(_mentions(a, target) for a in _args(tp))
    return False


def _is_callable_type(tp: Any) -> bool:
    if _is_union(tp):
        return any(_is_callable_type(a) for a in _args(tp))
    return tp is typing.Callable or str(tp).startswith("typing.Callable") or str(
        typing.get_origin(tp)).endswith("Callable'>")


def float_only(tp: Any) -> bool:
    """True for float / Optional[float] annotations (ints given there are written as floats)."""
    return _mentions(tp, float) and not _mentions(tp, int)


def coerce_value(value: Any, tp: Any, path: str) -> Any:
    """Convert a parsed YAML/dotlist value to the field's type, or raise a one-line ConfigError."""
    if _mentions(tp, torch.dtype) and value is not None:
        return parse_dtype(value, path)
    if _is_callable_type(tp) and value is not None:
        return parse_callable(value, path)
    if check_value(value, tp):
        # Keep floats as floats so that a YAML '0' for a float field writes back the same way.
        if float_only(tp) and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, tuple):
            return list(value)
        return value
    if isinstance(value, str) and _mentions(tp, float):
        try:
            return float(value)  # YAML 1.1 reads '3e-4' as a string
        except ValueError:
            pass
    if _is_union(tp):
        for arm in _args(tp):
            if typing.get_origin(arm) in (list, tuple) and isinstance(value, (list, tuple)):
                inner = _args(arm)
                if inner:
                    return [coerce_value(v, inner[0], f"{path}[{i}]") for i, v in enumerate(value)]
    if typing.get_origin(tp) in (list, tuple) and isinstance(value, (list, tuple)) and _args(tp):
        return [coerce_value(v, _args(tp)[0], f"{path}[{i}]") for i, v in enumerate(value)]
    raise _error(path, value, tp)


def check_dataclass_types(obj: Any, prefix: str) -> None:
    """Raise ConfigError for the first field of ``obj`` whose value does not fit its annotation."""
    hints = field_types(type(obj))
    for f in yaml_fields(obj):
        if is_derived_field(f):
            continue
        value = getattr(obj, f.name)
        if not check_value(value, hints[f.name]):
            raise _error(f"{prefix}.{f.name}", value, hints[f.name])


def check_container_types(cfg: Any) -> None:
    """Type-check every section of a ConfigContainer (sections that are dataclasses)."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            check_dataclass_types(value, f.name)
        elif f.name == "mixed_precision" and value is not None and not isinstance(value, str):
            raise ConfigError(f"mixed_precision={value!r} must be a recipe name or a MixedPrecisionConfig")
