"""dist.high_priority_stream_groups / nccl_communicator_config_path: checked everywhere, NCCL options on CUDA."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace as NS

import pytest
import torch
import torch.distributed as dist
import torch.distributed.device_mesh as device_mesh

from longspan.config.nccl_groups import nccl_group_settings
from longspan.config.support import inapplicable_fields
from longspan.core.errors import ConfigError
from longspan.parallel import nccl_options
from longspan.parallel.mesh import build_device_mesh
from tests.training.pretrain_helpers import small_config


def test_settings_are_read_and_checked(tmp_path: Path) -> None:
    path = tmp_path / "nccl.yaml"
    path.write_text("dp:\n  max_ctas: 16\ntp:\n  cga_cluster_size: 2\n  min_ctas: 2\n")
    settings = nccl_group_settings(NS(high_priority_stream_groups=["tp", "pp"], nccl_communicator_config_path=str(path)))
    assert settings == {"tp": {"high_priority": True, "cga_cluster_size": 2, "max_ctas": 32, "min_ctas": 2},
                        "pp": {"high_priority": True},
                        "dp": {"high_priority": False, "cga_cluster_size": 4, "max_ctas": 16, "min_ctas": 1}}
    cfg = small_config(tmp_path)
    cfg.dist.high_priority_stream_groups, cfg.dist.nccl_communicator_config_path = ["tp"], str(path)
    cfg.validate(world_size=1)
    listed = "dist.high_priority_stream_groups=['tp']" in inapplicable_fields(cfg)
    assert listed == (not torch.cuda.is_available())
    for field, value, fragment in (
            ("high_priority_stream_groups", ["dp", "embd"], "names unknown group\\(s\\) embd: longspan's groups are"),
            ("nccl_communicator_config_path", str(tmp_path / "none.yaml"), "none.yaml' does not exist")):
        bad = small_config(tmp_path)
        setattr(bad.dist, field, value)
        with pytest.raises(ConfigError, match=fragment):
            bad.validate(world_size=1)
    path.write_text("dp:\n  max_ctas: -1\n")
    with pytest.raises(ConfigError, match="group 'dp' takes positive integers"):
        nccl_group_settings(NS(high_priority_stream_groups=None, nccl_communicator_config_path=str(path)))


class _FakeOptions:
    def __init__(self) -> None:
        self.is_high_priority_stream = False
        self.config = NS()


class _FakeMesh:
    """Records what build_device_mesh asks DeviceMesh and _flatten for."""
    created: list = []

    def __init__(self, device_type, grid, mesh_dim_names, backend_override=None) -> None:
        _FakeMesh.created.append((mesh_dim_names, backend_override))

    def __getitem__(self, parts):
        return self

    def _flatten(self, name, backend_override=None):
        _FakeMesh.created.append((name, backend_override))
        return self


def test_options_reach_the_named_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dist, "ProcessGroupNCCL", NS(Options=_FakeOptions), raising=False)
    options = nccl_options.nccl_group_options(NS(high_priority_stream_groups=["tp", "dp"],
                                                 nccl_communicator_config_path=None))
    assert options["tp"].is_high_priority_stream and not hasattr(options["tp"].config, "max_ctas")
    monkeypatch.setattr(device_mesh, "DeviceMesh", _FakeMesh)
    _FakeMesh.created = []
    build_device_mesh(4, tp=2, group_options=options)
    dense_names, dense_override = _FakeMesh.created[0]
    assert dict(zip(dense_names, dense_override))["tp"] == (None, options["tp"])
    assert dict(zip(dense_names, dense_override))["pp"] == (None, None)
    flattened = dict(_FakeMesh.created[1:])
    assert flattened["dp"] is options["dp"] and flattened["dp_cp"] is None
    assert nccl_options.nccl_group_options(NS(high_priority_stream_groups=None,
                                              nccl_communicator_config_path=None)) == {}


# ------------------------------------------------------------------------------------- dist.use_sharp


class _SharpMeshes:
    def __getitem__(self, name):
        return NS(get_group=lambda: f"group:{name}")


def _create_groups_with_sharp(monkeypatch: pytest.MonkeyPatch, use_sharp: bool) -> dict:
    """initialize_distributed's group creation on a pretend CUDA rank of 2, torch's side recorded."""
    from longspan.config.schema.infra import DistributedInitConfig
    from longspan.core.model_parallel_config import ModelParallelConfig
    from longspan.parallel import init
    from longspan.parallel.mesh import layout_from_config

    seen: dict = {"env_at_pg": "unset", "barriers": []}
    monkeypatch.setenv(nccl_options.COLLNET_ENV, "1")  # a user export: SHARP must not reach the first groups

    def fake_init_pg(dist_cfg, launch, backend, dev, eager_nccl=True):
        seen["eager_nccl"], seen["env_at_pg"] = eager_nccl, os.environ.get(nccl_options.COLLNET_ENV)

    def fake_barrier(group, device):
        seen["barriers"].append((group, os.environ.get(nccl_options.COLLNET_ENV)))

    monkeypatch.setattr(init, "_init_process_group", fake_init_pg)
    monkeypatch.setattr(init, "build_device_mesh", lambda *a, **k: _SharpMeshes())
    monkeypatch.setattr(nccl_options, "_device_barrier", fake_barrier)
    dist_cfg = DistributedInitConfig(use_sharp=use_sharp)
    mp = ModelParallelConfig()
    launch = init.LaunchEnv("torchrun", 0, 2, 0, "127.0.0.1", 29500)
    try:
        init._create_groups(dist_cfg, mp, launch, layout_from_config(2, mp), 0, NS(type="cuda", index=0), "nccl")
    finally:
        init._STATE = None
    seen["env_after"] = os.environ.get(nccl_options.COLLNET_ENV)
    return seen


def test_sharp_enables_collnet_for_the_data_parallel_communicator_only(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _create_groups_with_sharp(monkeypatch, use_sharp=True)
    # cleared before the default group, lazy NCCL communicators, set only while dp x cp's is created
    assert seen["env_at_pg"] is None and seen["eager_nccl"] is False
    assert seen["barriers"] == [("group:dp_cp", "1")] and seen["env_after"] is None


def test_without_sharp_nothing_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _create_groups_with_sharp(monkeypatch, use_sharp=False)
    assert seen["env_at_pg"] == "1" and seen["eager_nccl"] is True  # the user's environment is theirs
    assert seen["barriers"] == [] and seen["env_after"] == "1"


def test_sharp_applies_to_nccl_on_cuda_and_is_listed_elsewhere(tmp_path: Path) -> None:
    on = NS(use_sharp=True)
    assert nccl_options.sharp_applies(on, "nccl", NS(type="cuda"))
    assert not nccl_options.sharp_applies(on, "gloo", NS(type="cpu"))
    assert not nccl_options.sharp_applies(NS(use_sharp=False), "nccl", NS(type="cuda"))
    cfg = small_config(tmp_path)
    cfg.dist.use_sharp = True
    cfg.validate(world_size=1)
    assert ("dist.use_sharp=True" in inapplicable_fields(cfg)) == (not torch.cuda.is_available())
    cfg.dist.distributed_backend = "gloo"
    with pytest.raises(ConfigError, match=r"dist.use_sharp=True is an NCCL feature \(CollNet\) but dist.distributed_backend='gloo'"):
        cfg.validate(world_size=1)
