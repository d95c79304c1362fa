"""Resuming a learning-rate schedule built from a config: a longer run follows the config, a changed schedule is
one error in the config's units naming both switches, and an unchanged one is restored silently."""

from __future__ import annotations

import pytest
import torch

from longspan.config.schema.optim import OptimizerConfig
from longspan.config.schema.training import SchedulerConfig, TrainingConfig
from longspan.core.errors import CheckpointError
from longspan.training.optim.scheduler import get_optimizer_param_scheduler

GBS = 16


def _scheduler(train_iters=None, train_samples=None, **scheduler_fields):
    warmup = {"lr_warmup_fraction": 0.05} if train_samples is None else {"lr_warmup_samples": 320}
    fields = {"lr_decay_style": "cosine", **warmup, **scheduler_fields}
    sched_cfg = SchedulerConfig(**fields)
    train_cfg = TrainingConfig(train_iters=train_iters, train_samples=train_samples, global_batch_size=GBS)
    opt_cfg = OptimizerConfig(lr=3e-3, min_lr=3e-4, weight_decay=0.01)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.0)
    return get_optimizer_param_scheduler(optimizer, sched_cfg, train_cfg, opt_cfg)


def _finished(**kwargs):
    """The state dict of a schedule run to its end (the quickstart's 200 iterations)."""
    done = _scheduler(**kwargs)
    done.step(done.wd_incr_steps)
    return done.state_dict()


def test_a_longer_run_follows_the_config_and_says_so_once(captured):
    state = _finished(train_iters=200)
    longer = _scheduler(train_iters=400)
    longer.load_state_dict(dict(state))
    reference = _scheduler(train_iters=400)  # the schedule a 400-iteration run has at iteration 200
    reference.step(200 * GBS)
    assert longer.lr_decay_steps == 400 * GBS and longer.lr_warmup_steps == pytest.approx(20 * GBS)
    assert longer.optimizer.param_groups[0]["lr"] == reference.optimizer.param_groups[0]["lr"] > 3e-4
    lines = [r for r in captured if "schedule" in r]
    assert lines == ["> train.train_iters=400, the checkpoint's schedule was for 200: the learning-rate schedule "
                     "follows this config (warmup 20 iterations, decay over 400 iterations); "
                     "scheduler.use_checkpoint_opt_param_scheduler=true keeps the checkpoint's"]
    kept = _scheduler(train_iters=400, use_checkpoint_opt_param_scheduler=True)
    kept.load_state_dict(dict(state))
    assert kept.lr_decay_steps == 200 * GBS and kept.optimizer.param_groups[0]["lr"] == pytest.approx(3e-4)


def test_a_changed_schedule_is_one_error_in_iterations_naming_the_field_and_both_switches():
    state = _finished(train_iters=200)
    with pytest.raises(CheckpointError) as err:
        _scheduler(train_iters=200, lr_decay_iters=150).load_state_dict(dict(state))
    message = str(err.value)
    assert "decay length (scheduler.lr_decay_iters): this config gives 150 iterations, the checkpoint 200 " \
           "iterations" in message
    assert "warmup (scheduler.lr_warmup_fraction): this config gives 7.5 iterations, the checkpoint 10 " \
           "iterations" in message
    assert "scheduler.override_opt_param_scheduler=true" in message
    assert "scheduler.use_checkpoint_opt_param_scheduler=true" in message
    assert "\n" not in message and "samples" not in message


def test_a_sample_based_schedule_speaks_in_samples():
    state = _finished(train_samples=3200)
    with pytest.raises(CheckpointError, match=r"warmup \(scheduler.lr_warmup_samples\): this config gives 160 "
                                              r"samples, the checkpoint 320 samples"):
        _scheduler(train_samples=3200, lr_warmup_samples=160).load_state_dict(dict(state))
    longer = _scheduler(train_samples=6400)
    longer.load_state_dict(dict(state))  # a longer sample-based run follows its config too
    assert longer.lr_decay_steps == 6400


def test_an_unchanged_schedule_resumes_without_a_line_per_value(captured):
    state = _finished(train_iters=200)
    same = _scheduler(train_iters=200)
    captured.clear()  # the constructor's "> learning rate decay style" line
    same.load_state_dict(dict(state))
    assert same.num_steps == 200 * GBS
    assert captured == []  # Megatron's nine "> using checkpoint value" lines said nothing new
    changed = _scheduler(train_iters=200, lr_decay_iters=150, override_opt_param_scheduler=True)
    captured.clear()
    changed.load_state_dict(dict(state))
    assert len(captured) == 1 and captured[0].startswith("> learning-rate schedule: following this config")
    assert "decay length (scheduler.lr_decay_iters) 150 iterations (the checkpoint's: 200 iterations)" in captured[0]
