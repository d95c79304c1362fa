"""checkpoint.dist_ckpt_strictness: Megatron's eight ways of handling tensors the checkpoint and the model do not
share (megatron-core's StrictHandling), on key sets and on a real load into a model with QK-norms the checkpoint
lacks."""

from __future__ import annotations

import logging

import pytest
import torch

from longspan.core.errors import CheckpointError
from longspan.training.checkpointing.strictness import apply_strictness
from longspan.training.pretrain import pretrain
from longspan.training.setup import setup
from tests.training.pretrain_helpers import tiniest_config

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


def test_a_model_with_tensors_the_checkpoint_lacks_loads_the_rest(tmp_path) -> None:
    source = tiniest_config(tmp_path, "source", train_iters=2)
    source.checkpoint.save_interval = 2
    pretrain(source)

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
