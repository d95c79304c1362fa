"""Aux-loss-free expert bias across layouts and resume: ``tiny-moe`` with sigmoid routing and expert bias.

- Data parallel 2 and expert parallel 2 (each on 2 ranks) train the same model as one process: losses within
  1e-5, and after every step the expert bias is bit-identical on both ranks and equal to one process's (the
  token counts are summed over the data-parallel group before the update).
- The trainer (``pretrain``) under EP2 on 2 ranks gives one process's losses and final-checkpoint biases.
- Stop/resume of the trainer (``pretrain``, exit after 3 of 6 iterations) gives the straight run's losses bit
  for bit; a control that zeroes the bias on load drifts, so the checkpointed bias is what makes it pass.
"""

from __future__ import annotations

import math

import pytest

from tests.parallel.harness import get_shared_pool
from tests.parallel.test_moe_parity import GBS, MBS, _global_batches, moe_config

REL_TOL = 1e-5
RATE = 0.05  # large enough that the bias changes the routing within a few steps
ITERS = 4


def bias_config(ep: int = 1, rate: float = RATE):
    cfg = moe_config(ep=ep)
    cfg.model.moe_router_score_function = "sigmoid"
    cfg.model.moe_router_enable_expert_bias = True
    cfg.model.moe_router_bias_update_rate = rate
    cfg.model.moe_aux_loss_coeff = 0.0
    return cfg


def train_with_bias(ep: int = 1, rate: float = RATE, iters: int = ITERS) -> dict:
    """Model + optimizer level training (tests/parallel/layout_training.py), one bias update per step."""
    from longspan.models.moe import moe_layers
    from longspan.models.moe_router import set_aux_loss_scale
    from longspan.parallel.expert_parallel import update_expert_biases
    from tests.parallel.layout_training import build_layout_model, train_on_global_batches

    parallel, model, optimizer = build_layout_model(bias_config(ep=ep, rate=rate))
    set_aux_loss_scale(1.0 / (GBS // (MBS * parallel.dp_size)))
    losses, biases = [], []
    for batch in _global_batches(iters):
        step_losses, _ = train_on_global_batches(model, optimizer, parallel, [batch], GBS, MBS)
        update_expert_biases(model, parallel)
        losses += step_losses
        biases.append([layer.router.expert_bias.clone() for layer in moe_layers(model)])
    return {"losses": losses, "biases": biases}


_REFERENCE: dict = {}


def _reference(rate: float = RATE) -> dict:
    if rate not in _REFERENCE:
        _REFERENCE[rate] = train_with_bias(rate=rate)
    return _REFERENCE[rate]


def _check_layout(results: list[dict], what: str) -> None:
    import torch

    ref = _reference()
    for r in results:
        for i, (got, want) in enumerate(zip(r["losses"], ref["losses"])):
            assert math.isclose(got, want, rel_tol=REL_TOL), f"{what} iteration {i + 1}: {got} vs {want}"
        for step, (got, want) in enumerate(zip(r["biases"], ref["biases"])):
            for layer, (g, w) in enumerate(zip(got, want)):
                assert torch.equal(g, w), f"{what} step {step + 1} layer {layer}: bias {g} vs one process {w}"
    for step in range(ITERS):  # the ranks agree with each other bit for bit
        for a, b in zip(results[0]["biases"][step], results[1]["biases"][step]):
            assert torch.equal(a, b)


def test_reference_bias_moves_and_changes_the_losses():
    """The one-process reference: the bias leaves zero after the first step and changes later losses."""
    ref = _reference()
    assert all(float(b.abs().max()) == pytest.approx(RATE) for b in ref["biases"][0])
    frozen = _reference(rate=0.0)
    assert ref["losses"][0] == frozen["losses"][0]  # the first step routes with a zero bias either way
    assert ref["losses"][1:] != frozen["losses"][1:]


@pytest.mark.slow
def test_dp2_keeps_the_bias_identical_and_equal_to_one_process():
    _check_layout(get_shared_pool(2).run(train_with_bias, 1, timeout=240), "DP2")


@pytest.mark.slow
def test_ep2_with_expert_bias_matches_one_process():
    _check_layout(get_shared_pool(2).run(train_with_bias, 2, timeout=240), "EP2")


# ------------------------------------------------------------------------------------- resume through pretrain

RESUME_ITERS = 6


def _pretrain_config(tmp_path, name: str, exit_interval: int | None = None, ep: int = 1):
    cfg = bias_config(ep=ep)
    cfg.train.train_iters = RESUME_ITERS
    cfg.train.exit_interval = exit_interval
    cfg.train.eval_interval = None
    cfg.train.eval_iters = 0
    cfg.scheduler.lr_warmup_fraction = None
    cfg.scheduler.lr_warmup_iters = 1
    run_dir = tmp_path / name
    cfg.checkpoint.save = str(run_dir / "ckpt")
    cfg.checkpoint.load = str(run_dir / "ckpt")
    cfg.checkpoint.save_interval = None
    cfg.logger.tensorboard_dir = str(run_dir / "tb")
    cfg.logger.log_interval = 1
    return cfg


def _losses(cfg) -> dict[int, float]:
    from tests.training.pretrain_helpers import losses_by_iteration

    return losses_by_iteration(cfg)


def _saved_bias(cfg) -> list:
    """The expert biases of the last checkpoint of ``cfg``'s run, read with DCP."""
    import torch
    import torch.distributed.checkpoint as dcp

    from longspan.training.checkpointing.save import read_tracker, get_checkpoint_dir

    iteration = read_tracker(cfg.checkpoint.save)
    want = {"model": {f"decoder.layers.{i}.mlp.router.expert_bias": torch.empty(4) for i in range(2)}}
    dcp.load(want, checkpoint_id=get_checkpoint_dir(cfg.checkpoint.save, iteration))
    return list(want["model"].values())


def test_stop_and_resume_with_expert_bias_is_bit_exact(tmp_path, monkeypatch):
    from longspan.training.pretrain import pretrain

    straight = _pretrain_config(tmp_path, "straight")
    pretrain(straight)
    reference = _losses(straight)
    assert sorted(reference) == list(range(1, RESUME_ITERS + 1))

    stopped = _pretrain_config(tmp_path, "resumed", exit_interval=3)
    pretrain(stopped)
    assert sorted(_losses(stopped)) == [1, 2, 3]
    resumed_cfg = _pretrain_config(tmp_path, "resumed")
    pretrain(resumed_cfg)
    resumed = _losses(resumed_cfg)
    assert [resumed[i] for i in range(1, RESUME_ITERS + 1)] == [reference[i] for i in range(1, RESUME_ITERS + 1)]
    import torch

    for got, want in zip(_saved_bias(resumed_cfg), _saved_bias(straight)):
        assert torch.equal(got, want)

    # Control: a resume that loses the bias (zeroed after loading) drifts.
    from longspan.models.moe_router import TopKRouter

    real_load = TopKRouter._load_from_state_dict

    def load_then_forget(self, *args, **kwargs):
        real_load(self, *args, **kwargs)
        if self.expert_bias is not None:
            self.expert_bias.zero_()

    stopped = _pretrain_config(tmp_path, "control", exit_interval=3)
    pretrain(stopped)
    monkeypatch.setattr(TopKRouter, "_load_from_state_dict", load_then_forget)
    control_cfg = _pretrain_config(tmp_path, "control")
    pretrain(control_cfg)
    control = _losses(control_cfg)
    assert [control[i] for i in range(4, RESUME_ITERS + 1)] != [reference[i] for i in range(4, RESUME_ITERS + 1)]


def _pretrain_ep_task(tmp_path, name: str, ep: int) -> None:
    from longspan.training.pretrain import pretrain

    pretrain(_pretrain_config(tmp_path, name, ep=ep))


@pytest.mark.slow
def test_pretrain_ep2_with_expert_bias_matches_one_process(tmp_path):
    """The trainer's own step (train_step's update over the dp x cp group) under EP2 on 2 ranks: the losses
    of one process within 1e-5 and the same biases in the final checkpoint."""
    import torch

    from longspan.training.pretrain import pretrain

    single = _pretrain_config(tmp_path, "single")
    pretrain(single)
    get_shared_pool(2).run(_pretrain_ep_task, tmp_path, "ep2", 2, timeout=300)
    ep2 = _pretrain_config(tmp_path, "ep2", ep=2)
    want, got = _losses(single), _losses(ep2)
    assert sorted(got) == sorted(want) == list(range(1, RESUME_ITERS + 1))
    for i in want:
        assert math.isclose(got[i], want[i], rel_tol=REL_TOL), f"iteration {i}: {got[i]} vs {want[i]}"
    for g, w in zip(_saved_bias(ep2), _saved_bias(single)):
        assert torch.equal(g, w)
