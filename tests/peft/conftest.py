"""Shared fixtures of the PEFT tests: worker pools for the layout tests and one small pretrained base."""

from pathlib import Path

import pytest

from longspan.training.pretrain import pretrain
from longspan.training.step.forward_step import forward_step
from tests.parallel.conftest import pool2  # noqa: F401
from tests.training.pretrain_helpers import small_config


@pytest.fixture(scope="session")
def base_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small pretrained base (a few iterations of the tiny model), saved without optimizer state; the tests
    finetune from it and never write into it."""
    tmp = tmp_path_factory.mktemp("peft_base")
    cfg = small_config(tmp, "base", train_iters=4)
    cfg.checkpoint.save_optim = False
    cfg.checkpoint.save_interval = 4
    cfg.train.eval_iters = 0
    pretrain(cfg, forward_step)
    return Path(cfg.checkpoint.save)
