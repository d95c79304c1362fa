"""Every field longspan does not support says why: in docs/config-support.md and in the NotSupportedError."""

from __future__ import annotations

import dataclasses

import pytest

from longspan.config.support import (
    NOT_SUPPORTED,
    NOT_SUPPORTED_REASONS,
    field_status,
    not_supported_reason,
)
from longspan.config.support_doc import _section_classes
from longspan.config.types import is_derived_field, yaml_fields
from longspan.core.errors import NotSupportedError
from longspan.training.config import ConfigContainer

def _not_supported_rows() -> list[tuple[str, str, str]]:
    rows = []
    for section, cls in _section_classes():
        for f in yaml_fields(cls):
            if not is_derived_field(f) and field_status(section, f.name, cls.__name__) == NOT_SUPPORTED:
                rows.append((section, cls.__name__, f.name))
    return rows


def test_every_not_supported_row_has_a_one_line_reason() -> None:
    missing = [f"{cls}.{name} ({section})" for section, cls, name in _not_supported_rows()
               if not not_supported_reason(section, name, cls)]
    assert missing == [], f"not-supported rows without a reason in NOT_SUPPORTED_REASONS: {missing}"
    for key, reason in NOT_SUPPORTED_REASONS.items():
        assert reason.strip() and "\n" not in reason and len(reason) <= 200, key


def test_reasons_name_existing_not_supported_fields() -> None:
    rows = _not_supported_rows()
    keys = {f"{section}.{name}" for section, _, name in rows} | {f"{cls}.{name}" for _, cls, name in rows}
    stale = sorted(set(NOT_SUPPORTED_REASONS) - keys)
    assert stale == [], f"reasons for fields that are supported or do not exist: {stale}"


def test_reason_ends_the_error_and_the_doc_row(monkeypatch: pytest.MonkeyPatch) -> None:
    from longspan.config.support import check_supported
    from longspan.config.support_doc import render

    monkeypatch.setitem(NOT_SUPPORTED_REASONS, "dist.enable_megatron_core_experimental", "a probe reason")
    cfg = ConfigContainer.__new__(ConfigContainer)
    for f in dataclasses.fields(ConfigContainer):
        object.__setattr__(cfg, f.name, None)
    from longspan.config.schema.infra import DistributedInitConfig

    cfg.dist = DistributedInitConfig(enable_megatron_core_experimental=True)
    with pytest.raises(NotSupportedError) as err:
        check_supported(cfg)
    assert str(err.value) == ("dist.enable_megatron_core_experimental=True is not supported yet by longspan "
                              "(supported: False): a probe reason")
    assert "| not supported yet: a probe reason |" in render()


def test_switches_that_change_nothing_here_validate_and_are_listed(tmp_path) -> None:
    from longspan.config.support import inapplicable_fields
    from tests.training.pretrain_helpers import small_config

    cfg = small_config(tmp_path)
    cfg.model.transformer_impl, cfg.model.apply_query_key_layer_scaling = "local", True
    cfg.dist.align_grad_reduce, cfg.dataset.num_dataset_builder_threads = False, 4
    cfg.validate(world_size=1)
    listed = inapplicable_fields(cfg)
    assert "model.transformer_impl='local'" in listed and "model.apply_query_key_layer_scaling=True" in listed
    assert "dataset.num_dataset_builder_threads=4" in listed
