"""checkpoint.ckpt_convert_format / ckpt_convert_save: a conversion run loads checkpoint.load, writes it as
torch_dist under {ckpt_convert_save}/torch_dist at the loaded iteration, and stops without training."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from longspan.core.errors import ConfigError, NotSupportedError
from longspan.training.pretrain import pretrain
from tests.training.pretrain_helpers import losses_by_iteration, tiniest_config


def test_conversion_writes_the_loaded_state_and_trains_nothing(tmp_path) -> None:
    source = tiniest_config(tmp_path, "source", train_iters=2)
    source.checkpoint.save_interval = 2
    pretrain(source)

    convert = tiniest_config(tmp_path, "convert", train_iters=2)
    convert.checkpoint.load, convert.checkpoint.save = source.checkpoint.save, None
    convert.checkpoint.ckpt_convert_format = "torch_dist"
    convert.checkpoint.ckpt_convert_save = str(tmp_path / "converted")
    convert.checkpoint.storage_writers_per_rank = 2  # written the conversion run's way
    state = pretrain(convert)
    assert state.train_state.step == 2 and not losses_by_iteration_or_empty(convert)

    written = tmp_path / "converted" / "torch_dist"
    assert (written / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert sorted(p.name for p in (written / "iter_0000002").glob("*.distcp")) == ["__0_0.distcp", "__0_1.distcp"]
    dcp_to_torch_save(str(Path(source.checkpoint.save) / "iter_0000002"), str(tmp_path / "a.pt"))
    dcp_to_torch_save(str(written / "iter_0000002"), str(tmp_path / "b.pt"))
    a, b = torch.load(tmp_path / "a.pt", weights_only=False), torch.load(tmp_path / "b.pt", weights_only=False)
    for section in ("model", "optimizer"):
        assert a[section].keys() == b[section].keys()
        for key, value in a[section].items():
            same = torch.equal(value, b[section][key]) if isinstance(value, torch.Tensor) else value == b[section][key]
            assert same, key


def losses_by_iteration_or_empty(cfg) -> dict:
    return losses_by_iteration(cfg) if (Path(cfg.logger.tensorboard_dir) / "metrics.jsonl").exists() else {}


@pytest.mark.parametrize("fields, error, message", [
    ({"ckpt_convert_format": "torch", "ckpt_convert_save": "x", "load": "y"}, NotSupportedError,
     "ckpt_convert_format='torch' is not supported yet"),
    ({"ckpt_convert_format": "torch_dist", "load": "y"}, ConfigError, "needs checkpoint.ckpt_convert_save"),
    ({"ckpt_convert_save": "x"}, ConfigError, "needs checkpoint.ckpt_convert_format"),
], ids=["torch", "no-save-dir", "no-format"])
def test_conversion_settings_that_cannot_work(tmp_path, fields, error, message) -> None:
    cfg = tiniest_config(tmp_path, train_iters=2)
    for key, value in fields.items():
        setattr(cfg.checkpoint, key, value)
    with pytest.raises(error, match=message):
        cfg.validate(world_size=1)
