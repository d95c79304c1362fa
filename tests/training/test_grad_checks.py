"""ddp.check_for_nan_in_grad / ddp.check_for_large_grads: the reduced gradients are checked before the update."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

import longspan.training.step.grad_checks as grad_checks
from longspan.training.pretrain import pretrain
from longspan.training.step.forward_step import forward_step
from longspan.training.step.loss_checks import TrainingDivergedError
from tests.training.pretrain_helpers import read_metrics, tiniest_config


def _tiny(tmp_path: Path, **ddp: Any) -> Any:
    cfg = tiniest_config(tmp_path, "run", train_iters=5)
    cfg.logger.tensorboard_dir = None
    cfg.checkpoint.save = cfg.checkpoint.load = None
    for key, value in ddp.items():
        setattr(cfg.ddp, key, value)
    return cfg


def _forward_step_scaling_grads_at(iteration: int, factor: float):
    """The default forward step, with a hook multiplying one weight's gradient by ``factor`` in ``iteration``."""
    def step(state: Any, data_iterator: Any, model: torch.nn.Module) -> Any:
        if state.train_state.step + 1 == iteration and not getattr(step, "hooked", False):
            step.hooked = True
            weight = next(p for n, p in model.named_parameters() if n.endswith("word_embeddings.weight"))
            weight.register_hook(lambda grad: grad * factor)
        return forward_step(state, data_iterator, model)
    return step


def test_nan_in_a_gradient_stops_the_run_naming_the_iteration(tmp_path: Path) -> None:
    cfg = _tiny(tmp_path, check_for_nan_in_grad=True)
    with pytest.raises(TrainingDivergedError, match=r"ddp.check_for_nan_in_grad: NaN/Inf .* at iteration 3 ") as exc:
        pretrain(cfg, _forward_step_scaling_grads_at(3, float("nan")))
    assert "\n" not in str(exc.value)


def test_without_the_check_the_nan_gradient_is_not_caught_here(tmp_path: Path) -> None:
    cfg = _tiny(tmp_path)  # the optimizer's own norm check (check_for_nan_in_loss) still stops it, differently
    cfg.rerun_state_machine.check_for_nan_in_loss = False
    cfg.logger.tensorboard_dir = str(tmp_path / "tb")
    state = pretrain(cfg, _forward_step_scaling_grads_at(3, float("nan")))
    assert state.train_state.step == 5  # nothing stopped the run
    records = read_metrics(cfg)
    assert [r["iteration"] for r in records] == [1, 2, 3, 4, 5]
    norms = [r["grad_norm"] for r in records]
    losses = [r["losses"]["lm loss"] for r in records]
    # metrics.jsonl writes NaN as null: finite before the hook, NaN at iteration 3, and the update applied it
    # (the next iterations' losses are NaN), where the check would have stopped before the update
    assert all(math.isfinite(x) for x in norms[:2] + losses[:3]), (norms, losses)
    assert norms[2] is None and losses[3:] == [None, None], (norms, losses)


def test_large_gradient_after_the_learned_scale_stops_the_run(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(grad_checks, "LARGE_GRAD_SAMPLES", 2)  # learn the scale from 2 iterations, not 100
    cfg = _tiny(tmp_path, check_for_large_grads=True)
    with pytest.raises(TrainingDivergedError, match=r"ddp.check_for_large_grads: .* at iteration 4 "):
        pretrain(cfg, _forward_step_scaling_grads_at(4, 1e4))
    # The same spike inside the learning window is not flagged (Megatron's first samples only learn the scale).
    pretrain(_tiny(tmp_path / "early", check_for_large_grads=True), _forward_step_scaling_grads_at(2, 1e4))
