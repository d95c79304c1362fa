"""Loading a bf16 checkpoint without its optimizer state (checkpoint.load_optim=False): the fp32 main params
follow the loaded bf16 weights, or with checkpoint.load_main_params_from_ckpt they are the checkpoint's own fp32
main params (which hold the updates below bf16 resolution)."""

from __future__ import annotations

import pytest
import torch

from longspan.core.errors import CheckpointError
from longspan.training.pretrain import pretrain
from longspan.training.setup import setup
from tests.training.pretrain_helpers import tiniest_config


def _main_params(optimizer) -> list[torch.Tensor]:
    return [p.detach().clone() for group in optimizer.fp32_from_float16_groups for p in group]


def _loaded(tmp_path, name: str, source, **checkpoint):
    cfg = tiniest_config(tmp_path, name, train_iters=2)
    cfg.mixed_precision = "bf16_mixed"
    cfg.checkpoint.load, cfg.checkpoint.save, cfg.checkpoint.load_optim = source.checkpoint.save, None, False
    for key, value in checkpoint.items():
        setattr(cfg.checkpoint, key, value)
    out = setup(cfg)
    model_params = [p.detach().float() for group in out.optimizer.float16_groups for p in group]
    return _main_params(out.optimizer), model_params


def test_main_params_follow_the_weights_or_come_from_the_checkpoint(tmp_path) -> None:
    source = tiniest_config(tmp_path, "source", train_iters=2)
    source.mixed_precision = "bf16_mixed"
    source.checkpoint.save_interval = 2
    pretrain(source)

    rebuilt, weights = _loaded(tmp_path, "rebuilt", source)
    for main, weight in zip(rebuilt, weights):
        assert torch.equal(main, weight)  # main params = the loaded bf16 weights, upcast
    exact, weights = _loaded(tmp_path, "exact", source, load_main_params_from_ckpt=True)
    assert any(not torch.equal(m, w) for m, w in zip(exact, weights))  # finer than bf16: the saved main params
    for main, weight in zip(exact, weights):
        assert torch.equal(main.to(torch.bfloat16).float(), weight)  # and the model holds them rounded


def test_load_main_params_needs_saved_main_params(tmp_path) -> None:
    from longspan.config.schema.training import CheckpointConfig
    from longspan.training.checkpointing.load import _main_params_without_optimizer
    from longspan.training.optim.optimizer import get_megatron_optimizer
    from tests.training.test_optimizer import opt_config, tiny

    model = tiny().to(torch.bfloat16)
    optimizer = get_megatron_optimizer(opt_config(bf16=True), [model])
    cfg = CheckpointConfig(load_main_params_from_ckpt=True)
    with pytest.raises(CheckpointError, match="load_main_params_from_ckpt=True but checkpoint /c holds no fp32 main"):
        _main_params_without_optimizer(cfg, optimizer, model, {"model.linear.weight"}, "/c", False, False)
    found = _main_params_without_optimizer(cfg, optimizer, model, {"main_params.linear.weight"}, "/c", False, False)
    assert set(found.state_dict()) == set(model.state_dict())
