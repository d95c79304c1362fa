"""model.pipeline_model_parallel_comm_backend: the pipeline group's backend (device-dependent)."""

from __future__ import annotations

import pytest
import torch

from longspan.core.errors import ConfigError
from longspan.parallel.init import pipeline_group_backend
from longspan.parallel.mesh import dim_backend_overrides


def test_backend_follows_the_device_and_the_torch_build():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert pipeline_group_backend(None, cuda, True) is None
    assert pipeline_group_backend("nccl", cuda, False) == "nccl"
    assert pipeline_group_backend("nccl", cpu, False) is None  # listed once at start-up as not applicable
    assert pipeline_group_backend("ucc", cpu, True) == "ucc"
    with pytest.raises(ConfigError, match="is_ucc_available") as err:
        pipeline_group_backend("ucc", cuda, False)
    assert "\n" not in str(err.value)


def test_only_the_pipeline_dim_of_the_mesh_gets_the_backend():
    dims = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    assert dim_backend_overrides(dims, {}, {"pp": None}) is None
    assert dim_backend_overrides(dims, {}, {"pp": "ucc"}) == (("ucc", None),) + ((None, None),) * 4
    options = object()
    assert dim_backend_overrides(dims, {"tp": options}, {"pp": "nccl"})[::4] == (("nccl", None), (None, options))


def test_inapplicable_on_cpu_is_listed_at_start_up(monkeypatch):
    from longspan.config import support
    from longspan.recipes.tiny import tiny

    monkeypatch.setattr(support, "_has_accelerator", lambda: False)
    cfg = tiny()
    cfg.model.pipeline_model_parallel_comm_backend = "nccl"
    assert "model.pipeline_model_parallel_comm_backend='nccl'" in support.inapplicable_fields(cfg)
