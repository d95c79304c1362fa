"""dist.high_priority_stream_groups / nccl_communicator_config_path: checked everywhere, NCCL options on CUDA."""

from __future__ import annotations

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
