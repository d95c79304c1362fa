"""checkpoint.most_recent_k: only the k newest complete checkpoints stay on disk, sync and async."""

from __future__ import annotations

from pathlib import Path

import pytest

from longspan.core.errors import ConfigError
from longspan.training.checkpointing.save import remove_old_checkpoints
from longspan.training.step.forward_step import forward_step
from longspan.training.pretrain import pretrain
from tests.training.pretrain_helpers import tiniest_config


def _tiny(tmp_path: Path, name: str, **checkpoint: object):
    cfg = tiniest_config(tmp_path, name, train_iters=10)
    cfg.logger.tensorboard_dir = None
    cfg.checkpoint.save_interval = 1
    for key, value in checkpoint.items():
        setattr(cfg.checkpoint, key, value)
    return cfg


def _iterations(root: Path) -> list[str]:
    return sorted(p.name for p in root.glob("iter_*"))


@pytest.mark.parametrize("async_save", [False, True])
def test_most_recent_k_keeps_the_two_newest_of_ten_saves(tmp_path: Path, async_save: bool) -> None:
    cfg = _tiny(tmp_path, "k2", most_recent_k=2, async_save=async_save)
    pretrain(cfg, forward_step)
    root = Path(cfg.checkpoint.save)
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "10"
    assert _iterations(root) == ["iter_0000009", "iter_0000010"]


def test_default_keeps_every_checkpoint(tmp_path: Path) -> None:
    cfg = _tiny(tmp_path, "all")
    cfg.train.train_iters = 4
    pretrain(cfg, forward_step)
    assert _iterations(Path(cfg.checkpoint.save)) == [f"iter_{i:07d}" for i in range(1, 5)]


def test_partial_and_protected_checkpoints_are_kept(tmp_path: Path) -> None:
    """A save killed mid-way leaves ``.partial`` (not complete: not counted, not removed); the iteration that
    ``load`` points at survives; the newest (the tracker's) is always kept."""
    for i in range(1, 7):
        (tmp_path / f"iter_{i:07d}").mkdir()
    (tmp_path / "iter_0000007.partial").mkdir()
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("6")
    remove_old_checkpoints(tmp_path, 1, protected={2})
    assert _iterations(tmp_path) == ["iter_0000002", "iter_0000006", "iter_0000007.partial"]


@pytest.mark.parametrize("value", [0, -2, 1.5])
def test_bad_most_recent_k_is_one_line(value: object) -> None:
    from longspan.config.rules.ranges import check_ranges
    from longspan.recipes import get_recipe

    cfg = get_recipe("tiny")
    cfg.checkpoint.most_recent_k = value
    with pytest.raises(ConfigError, match="checkpoint.most_recent_k"):
        check_ranges(cfg)
