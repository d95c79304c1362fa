"""model.tp_comm_overlap: the config rules and the start-up line everywhere, the torch switches it turns on (CUDA)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace as NS

import pytest
import torch

from longspan.config.support import inapplicable_fields
from longspan.core.errors import ConfigError
from longspan.parallel import async_tp
from tests.training.pretrain_helpers import small_config


def _cfg(tmp_path: Path, **model):
    cfg = small_config(tmp_path)
    cfg.model.tensor_model_parallel_size, cfg.model.sequence_parallel, cfg.model.tp_comm_overlap = 2, True, True
    for key, value in model.items():
        setattr(cfg.model, key, value)
    return cfg


def test_rules_and_the_not_applicable_line(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    cfg.validate(world_size=2)
    listed = "model.tp_comm_overlap=True" in inapplicable_fields(cfg)
    assert listed == (not torch.cuda.is_available())
    with pytest.raises(ConfigError, match="tp_comm_overlap=True needs model.sequence_parallel=True"):
        _cfg(tmp_path, sequence_parallel=False).validate(world_size=2)
    off = _cfg(tmp_path)
    off.train.torch_compile = False
    with pytest.raises(ConfigError, match="runs inside the compiled layers: set train.torch_compile=true"):
        off.validate(world_size=2)


def test_switches_turn_on_for_a_cuda_tensor_parallel_group(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group  # noqa: F401 - the real one exists

    enabled: list[str] = []
    inductor_config = NS(_micro_pipeline_tp=False)  # stands for torch._inductor.config (seconds to import)
    monkeypatch.setattr(async_tp, "_enable_symmetric_memory", enabled.append)
    monkeypatch.setattr(async_tp, "_inductor_config", lambda: inductor_config)
    on, group = NS(tp_comm_overlap=True), NS(group_name="tp-group")
    assert not async_tp.enable_async_tensor_parallel(on, group, torch.device("cpu"), compiled=True)
    assert not async_tp.enable_async_tensor_parallel(on, None, torch.device("cuda"), compiled=True)
    assert not async_tp.enable_async_tensor_parallel(on, group, torch.device("cuda"), compiled=False)
    assert not async_tp.enable_async_tensor_parallel(NS(tp_comm_overlap=False), group, torch.device("cuda"), True)
    assert enabled == [] and inductor_config._micro_pipeline_tp is False
    assert async_tp.enable_async_tensor_parallel(on, group, torch.device("cuda"), compiled=True)
    assert enabled == ["tp-group"] and inductor_config._micro_pipeline_tp is True
