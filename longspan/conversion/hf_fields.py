"""The two-way table between an HF config.json and a provider: one ``HFField`` per config.json key.

A family's translation is its table (usually ``DECODER_FIELDS`` with per-family overrides, as Megatron Bridge's
``CONFIG_MAPPING``) plus the few checks and derived fields a table cannot say (RoPE scalings, windows, dtype).
The same entry reads a key on import and writes it on export, so the two directions cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

from longspan.core.errors import ConfigError

REQUIRED = object()
"""``HFField.default`` for a key that config.json must have."""


@dataclass(frozen=True)
class HFField:
    """One config.json key and the provider field it becomes."""

    hf: str
    """The config.json key."""
    ours: str
    """The provider field."""
    default: Any = REQUIRED
    """Used when config.json lacks the key or holds null (or 0 / False with ``falsy_default``): a value, or a
    function of the config.json dict; ``REQUIRED`` makes a missing key an error naming it."""
    to_ours: Callable[[Any], Any] | None = None
    """Turns the config.json value into the provider's (e.g. ``float``, ``bool``)."""
    to_hf: Callable[[Any], Any] | None = None
    """Turns the provider's value into the config.json value (default: ``to_ours`` when it is a plain type)."""
    from_provider: Callable[[Any], Any] | None = None
    """Computes the config.json value from the whole provider (when it depends on other fields)."""
    falsy_default: bool = False
    """Take the default for a falsy value too (config.json's ``num_key_value_heads: 0`` means "as heads")."""
    export: bool = True
    """Written on export (False: read on import only)."""


def _default(field: HFField, cfg: dict[str, Any]) -> Any:
    if field.default is REQUIRED:
        raise ConfigError(f"config.json has no {field.hf!r}, which a {cfg.get('model_type', '?')} model needs")
    return field.default(cfg) if callable(field.default) else field.default


def import_fields(table: tuple[HFField, ...], cfg: dict[str, Any]) -> dict[str, Any]:
    """Provider keyword arguments from config.json dict ``cfg``, in table order."""
    out: dict[str, Any] = {}
    for field in table:
        value = cfg.get(field.hf)
        if value is None or (field.falsy_default and not value):
            value = _default(field, cfg)
        out[field.ours] = field.to_ours(value) if field.to_ours is not None else value
    return out


def export_fields(table: tuple[HFField, ...], provider: Any) -> dict[str, Any]:
    """config.json entries from ``provider``, in table order (the exported fields only)."""
    out: dict[str, Any] = {}
    for field in table:
        if not field.export:
            continue
        if field.from_provider is not None:
            out[field.hf] = field.from_provider(provider)
            continue
        value = getattr(provider, field.ours)
        convert = field.to_hf or (field.to_ours if field.to_ours in (int, float, bool, str) else None)
        out[field.hf] = convert(value) if convert is not None else value
    return out


def override(table: tuple[HFField, ...], *changes: HFField, drop: tuple[str, ...] = ()) -> tuple[HFField, ...]:
    """``table`` with entries replaced by config.json key (a new key is appended) and the ``drop`` keys removed."""
    by_key = {f.hf: f for f in changes}
    out = [by_key.pop(f.hf, f) for f in table if f.hf not in drop]
    return (*out, *by_key.values())


def with_default(table: tuple[HFField, ...], hf: str, default: Any) -> tuple[HFField, ...]:
    """``table`` with one key's import default changed (e.g. a family's own ``rms_norm_eps``)."""
    return tuple(replace(f, default=default) if f.hf == hf else f for f in table)
