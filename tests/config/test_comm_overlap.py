"""comm_overlap (Bridge's CommOverlapConfig): layout-derived overlap settings, the user's on top, onto the fields."""

from __future__ import annotations

from pathlib import Path

import pytest

from longspan.core.errors import ConfigError
from tests.training.pretrain_helpers import small_config


def _cfg(tmp_path: Path, comm_overlap: dict, **model):
    cfg = small_config(tmp_path)
    cfg.comm_overlap = comm_overlap
    for key, value in model.items():
        setattr(cfg.model, key, value)
    return cfg


def test_settings_follow_the_layout_and_the_users_values(tmp_path: Path) -> None:
    target = {"_target_": "megatron.bridge.training.comm_overlap.CommOverlapConfig", "tp_comm_overlap": True}
    cfg = _cfg(tmp_path, dict(target), tensor_model_parallel_size=2, sequence_parallel=True)
    cfg.optimizer.use_distributed_optimizer = True
    cfg.validate(world_size=4)  # tp 2 x dp 2
    assert (cfg.model.tp_comm_overlap, cfg.model.batch_p2p_comm, cfg.model.overlap_p2p_comm) == (True, False, False)
    assert (cfg.ddp.overlap_grad_reduce, cfg.ddp.overlap_param_gather, cfg.ddp.bucket_size) == (True, True, 128 << 20)
    # tensor parallel below 2: its overlap is switched off, as Bridge does; one data-parallel rank overlaps nothing
    one = _cfg(tmp_path, dict(target, bucket_size=1 << 20))
    one.validate(world_size=1)
    assert (one.model.tp_comm_overlap, one.ddp.overlap_grad_reduce, one.ddp.bucket_size) == (False, False, 1 << 20)
    pp = _cfg(tmp_path, {"tp_comm_overlap": False}, pipeline_model_parallel_size=2)
    pp.validate(world_size=2)
    assert (pp.model.batch_p2p_comm, pp.model.overlap_p2p_comm) == (True, False)


def test_bad_sections_are_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="comm_overlap has unknown key\\(s\\) tp_overlap: valid keys are"):
        _cfg(tmp_path, {"tp_overlap": True}).validate(world_size=1)
    with pytest.raises(ConfigError, match="comm_overlap.data_parallel_size=8 differs from the layout's"):
        _cfg(tmp_path, {"tp_comm_overlap": False, "data_parallel_size": 8}).validate(world_size=1)
    # a hint here, with megatron-core's rules: the deferral waits for a pipeline flush
    with pytest.raises(ConfigError, match="model.defer_embedding_wgrad_compute=True needs model.pipeline_model_parallel_size > 1"):
        _cfg(tmp_path, {"tp_comm_overlap": False, "defer_embedding_wgrad_compute": True}).validate(world_size=1)
