"""train.iterations_to_skip: the listed iterations' batches are read but not trained on (Megatron-LM's loop)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from longspan.core.errors import ConfigError
from longspan.training.pretrain import pretrain
from longspan.training.step.forward_step import forward_step
from tests.training.pretrain_helpers import losses_by_iteration, read_metrics, tiniest_config


def _tiny(tmp_path: Path, name: str, **train: Any) -> Any:
    cfg = tiniest_config(tmp_path, name, train_iters=6, **train)
    cfg.scheduler.lr_decay_style = "constant"  # the skipped run is then one update short on the same batches
    cfg.checkpoint.save = cfg.checkpoint.load = None
    return cfg


def test_skipped_iterations_consume_their_batches_without_training(tmp_path: Path) -> None:
    skipped = _tiny(tmp_path, "skip", iterations_to_skip=[2, 3])
    state = pretrain(skipped, forward_step)
    losses = losses_by_iteration(skipped)
    assert sorted(losses) == [1, 2, 5, 6]  # iterations 3 and 4 (after 2 and 3 completed) never ran
    assert state.train_state.step == 6
    assert state.train_state.consumed_train_samples == 12 and state.train_state.skipped_train_samples == 4
    # Iteration 5 trains the batch a plain run trains at iteration 5, on the weights after 2 updates: its loss
    # is the loss a run that never saw batches 3 and 4 would have; not the plain run's.
    plain = losses_by_iteration(_run(tmp_path, "plain"))
    assert losses[1] == plain[1] and losses[2] == plain[2]
    assert losses[5] != plain[5]
    records = read_metrics(skipped)
    assert [r["consumed_samples"] for r in records if r.get("phase") == "train"] == [2, 4, 10, 12]


def _run(tmp_path: Path, name: str) -> Any:
    cfg = _tiny(tmp_path, name)
    pretrain(cfg, forward_step)
    return cfg


@pytest.mark.parametrize("value", [[-1], [1.5], "3", [True]])
def test_bad_iterations_to_skip_is_one_line(value: object) -> None:
    from longspan.config.rules.ranges import check_ranges
    from longspan.recipes import get_recipe

    cfg = get_recipe("tiny")
    cfg.train.iterations_to_skip = value
    with pytest.raises(ConfigError, match="train.iterations_to_skip="):
        check_ranges(cfg)
