"""model.attention_backend: Megatron's names restrict SDPA's kernels for the whole run."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace as NS

import pytest
import torch

from longspan.config.rules.device_features import ATTENTION_BACKEND_NAMES
from longspan.config.support import inapplicable_fields
from longspan.core.errors import ConfigError
from longspan.models.attention_backend import ATTENTION_BACKENDS, attention_backend_context
from tests.training.pretrain_helpers import small_config


def _flags() -> tuple[bool, bool, bool]:
    b = torch.backends.cuda
    return b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.math_sdp_enabled()


def test_names_map_onto_sdpa_kernels_and_are_restored() -> None:
    assert tuple(ATTENTION_BACKENDS) == ATTENTION_BACKEND_NAMES
    before = _flags()
    cpu = torch.device("cpu")
    with attention_backend_context("unfused", cpu):
        assert _flags() == (False, False, True)
        q = torch.randn(1, 2, 4, 8)
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)  # math runs on a CPU
    with attention_backend_context("flash", cpu):
        assert _flags() == (True, False, False)
    for unrestricted in ("auto", "fused"):  # 'fused' is CUDA's: SDPA chooses on a CPU
        with attention_backend_context(unrestricted, cpu):
            assert _flags() == before
    with attention_backend_context("fused", torch.device("cuda")):
        assert _flags()[:2] == (False, True)
    assert _flags() == before


def test_pretrain_runs_inside_the_backend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from longspan.training import pretrain as pretrain_module

    cfg = small_config(tmp_path)
    cfg.model.attention_backend = "local"
    seen = []
    monkeypatch.setattr(pretrain_module, "setup", lambda c, callbacks=None: NS(state=NS(cfg=c, device=torch.device("cpu"))))
    monkeypatch.setattr(pretrain_module, "_train_and_test", lambda out, fn: seen.append(_flags()))
    pretrain_module.pretrain(cfg)
    assert seen == [(False, False, True)]


def test_values_are_checked_and_fused_is_listed_without_cuda(tmp_path: Path) -> None:
    cfg = small_config(tmp_path)
    cfg.model.attention_backend = "fused"
    cfg.validate(world_size=1)
    assert ("model.attention_backend='fused'" in inapplicable_fields(cfg)) == (not torch.cuda.is_available())
    cfg.model.attention_backend = "flash"
    assert "model.attention_backend='flash'" not in inapplicable_fields(cfg)
    cfg.model.attention_backend = "triton"
    with pytest.raises(ConfigError, match="model.attention_backend='triton' is not valid: use one of auto, flash"):
        cfg.validate(world_size=1)
