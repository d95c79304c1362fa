"""A dotted override through a field that is None creates that section with its defaults (as with Hydra)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

import pytest

from longspan.config.overrides import apply_overrides
from longspan.core.errors import ConfigError
from longspan.peft import LoRA
from longspan.recipes.loading import load_config
from longspan.data.sft.dataset import resolve_packed_specs


def test_packed_sequence_specs_is_created_then_filled(tmp_path) -> None:
    cfg = load_config("sft", [], ["dataset.packed_sequence_specs.packed_sequence_size=256"])
    assert cfg.dataset.packed_sequence_specs == {"packed_sequence_size": 256}
    specs = resolve_packed_specs(cfg.dataset.packed_sequence_specs)  # the other fields keep their defaults
    assert specs.packed_sequence_size == 256 and specs.pad_seq_to_mult == 1 and specs.pad_cu_seqlens is False
    # a later override changes one key and keeps the others
    apply_overrides(cfg, ["dataset.packed_sequence_specs.pad_cu_seqlens=true"])
    assert cfg.dataset.packed_sequence_specs == {"packed_sequence_size": 256, "pad_cu_seqlens": True}
    cfg.to_yaml(str(tmp_path / "cfg.yaml"))
    round_trip = type(cfg).from_yaml(str(tmp_path / "cfg.yaml"))
    assert round_trip.dataset.packed_sequence_specs == cfg.dataset.packed_sequence_specs


def test_peft_section_is_created_from_null() -> None:
    cfg = load_config("sft", [], ["peft=null", "peft.target_modules=[linear_qkv, linear_proj]"])
    assert isinstance(cfg.peft, LoRA) and cfg.peft.target_modules == ["linear_qkv", "linear_proj"]
    assert cfg.peft.dim == LoRA().dim  # the rest are LoRA's defaults
    cfg = load_config("sft", [], ["peft._target_=longspan.peft.DoRA", "peft.dim=4"])
    assert type(cfg.peft).__name__ == "DoRA" and cfg.peft.dim == 4


@dataclass
class _Adam:
    lr: float = 1e-3


@dataclass
class _Sgd:
    momentum: float = 0.9


@dataclass
class _Section:
    one: Optional[_Adam] = None
    either: Optional[Union[_Adam, _Sgd]] = None
    count: int = 1


@dataclass
class _Container:
    section: _Section = field(default_factory=_Section)


def test_an_optional_dataclass_field_is_created_and_an_ambiguous_one_asks_for_its_target() -> None:
    cfg = _Container()
    apply_overrides(cfg, ["section.one.lr=0.5"])
    assert cfg.section.one == _Adam(lr=0.5)
    with pytest.raises(ConfigError) as info:
        apply_overrides(cfg, ["section.either.lr=0.5"])
    assert "\n" not in str(info.value)
    assert "section.either is None and may hold" in str(info.value)
    assert "set section.either._target_=CLASS first" in str(info.value)
    with pytest.raises(ConfigError, match="section.count is a field, not a section"):
        apply_overrides(cfg, ["section.count.x=1"])
    with pytest.raises(ConfigError, match="unknown key 'section.one.lrr': did you mean lr"):
        apply_overrides(cfg, ["section.one.lrr=1"])
