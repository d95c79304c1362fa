"""Loading switches: checkpoint.dist_ckpt_strictness (megatron-core's eight StrictHandling modes for tensors the
checkpoint and the model do not share: on key sets, and a real load into a model with QK-norms the checkpoint
lacks) and checkpoint.ckpt_convert_format / ckpt_convert_save (a conversion run writes the loaded checkpoint as
torch_dist under {ckpt_convert_save}/torch_dist and stops without training). One saved run serves both."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from longspan.core.errors import CheckpointError, ConfigError, NotSupportedError
from longspan.training.checkpointing.strictness import apply_strictness
from longspan.training.pretrain import pretrain
from longspan.training.setup import setup
from tests.training.pretrain_helpers import tiniest_config


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A 2-iteration run with its checkpoint of iteration 2."""
    source = tiniest_config(tmp_path_factory.mktemp("saved"), "source", train_iters=2)
    source.checkpoint.save_interval = 2
    pretrain(source)
    return source

MODEL = {"a.weight": torch.zeros(1), "new.weight": torch.zeros(1)}  # new.weight: not in the checkpoint
STORED = {"model.a.weight", "model.old.weight", "optimizer.state.a.weight.exp_avg"}  # old.weight: not in the model


@pytest.mark.parametrize("mode, loaded, unexpected, missing, error", [
    ("assume_ok_unexpected", ["a.weight", "new.weight"], [], [], None),
    ("log_unexpected", ["a.weight"], ["new.weight"], [], None),
    ("log_all", ["a.weight"], ["new.weight"], ["old.weight"], None),
    ("raise_unexpected", None, None, None, "the model's tensors new.weight are not in it"),
    ("raise_all", None, None, None, "new.weight are not in it; its tensors old.weight are not in the model"),
    ("return_unexpected", ["a.weight"], ["new.weight"], [], None),
    ("return_all", ["a.weight"], ["new.weight"], ["old.weight"], None),
    ("ignore_all", ["a.weight"], [], [], None),
])
def test_each_mode_loads_reports_or_raises_as_megatron(caplog, mode, loaded, unexpected, missing, error) -> None:
    if error is not None:
        with pytest.raises(CheckpointError, match=f"dist_ckpt_strictness='{mode}'.*{error}"):
            apply_strictness(mode, MODEL, STORED, "/ckpt")
        return
    with caplog.at_level(logging.WARNING):
        got = apply_strictness(mode, MODEL, STORED, "/ckpt")
    assert (sorted(got[0]), got[1], got[2]) == (loaded, unexpected, missing)
    assert ("kept as they are: new.weight" in caplog.text) == mode.startswith("log")


def test_a_model_with_tensors_the_checkpoint_lacks_loads_the_rest(tmp_path, saved_run) -> None:
    source = saved_run

    def load(**checkpoint):
        cfg = tiniest_config(tmp_path, "qk", train_iters=2)
        cfg.model.qk_layernorm = True  # q_layernorm / k_layernorm weights the checkpoint does not have
        cfg.checkpoint.load, cfg.checkpoint.save, cfg.checkpoint.load_optim = source.checkpoint.save, None, False
        for key, value in checkpoint.items():
            setattr(cfg.checkpoint, key, value)
        return setup(cfg)

    with pytest.raises(CheckpointError, match="has no tensor decoder.layers.0.self_attention.q_layernorm.weight"):
        load()
    out = load(dist_ckpt_strictness="log_all")
    params = dict(out.model[0].named_parameters())
    assert out.state.train_state.step == 2  # the checkpoint of iteration 2 was loaded
    assert torch.equal(params["decoder.layers.0.self_attention.q_layernorm.weight"], torch.ones(8))  # kept


def test_conversion_writes_the_loaded_state_and_trains_nothing(tmp_path, saved_run) -> None:
    source = saved_run

    convert = tiniest_config(tmp_path, "convert", train_iters=2)
    convert.checkpoint.load, convert.checkpoint.save = source.checkpoint.save, None
    convert.checkpoint.ckpt_convert_format = "torch_dist"
    convert.checkpoint.ckpt_convert_save = str(tmp_path / "converted")
    convert.checkpoint.storage_writers_per_rank = 2  # written the conversion run's way
    state = pretrain(convert)
    assert state.train_state.step == 2 and not (Path(convert.logger.tensorboard_dir) / "metrics.jsonl").exists()

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
