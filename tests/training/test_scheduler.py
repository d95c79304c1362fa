"""OptimizerParamScheduler against megatron-core's, step for step, for every group of a multi-group optimizer."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from longspan.config.schema.optim import OptimizerConfig
from longspan.config.schema.training import SchedulerConfig, TrainingConfig
from longspan.core.errors import CheckpointError, ConfigError
from longspan.training.optim.scheduler import OptimizerParamScheduler, get_optimizer_param_scheduler

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler as MCoreScheduler

pytestmark = pytest.mark.megatron

GBS = 8


def make_optimizer(wd_override_group: bool = False) -> torch.optim.Optimizer:
    """A plain torch optimizer with the kinds of groups Megatron builds (and per-group overrides).

    ``wd_override_group`` adds a group with its own start_wd/end_wd (only valid with a non-constant
    weight-decay style: megatron-core asserts start == end for 'constant').
    """
    groups = [
        {"params": [torch.nn.Parameter(torch.zeros(2, 2))], "wd_mult": 1.0, "lr_mult": 1.0},
        {"params": [torch.nn.Parameter(torch.zeros(2))], "wd_mult": 0.0, "lr_mult": 1.0},
        # lr_mult is carried but (megatron-core 0.16) not applied by the scheduler.
        {"params": [torch.nn.Parameter(torch.zeros(3))], "wd_mult": 0.5, "lr_mult": 0.5},
        {"params": [torch.nn.Parameter(torch.zeros(3))], "max_lr": 2e-3, "min_lr": 2e-4, "wd_mult": 1.0},
        {"params": []},  # empty groups get values too
    ]
    if wd_override_group:
        groups.append({"params": [torch.nn.Parameter(torch.zeros(1))], "start_wd": 0.0, "end_wd": 0.3})
    return torch.optim.SGD(groups, lr=0.0)


BASE = dict(
    init_lr=0.0,
    max_lr=1e-3,
    min_lr=1e-4,
    lr_warmup_steps=10 * GBS,
    lr_decay_steps=100 * GBS,
    lr_decay_style="linear",
    start_wd=0.1,
    end_wd=0.1,
    wd_incr_steps=100 * GBS,
    wd_incr_style="constant",
)


def build_pair(**kwargs):
    args = {**BASE, **kwargs}
    wd_group = args["wd_incr_style"] != "constant"
    ours_opt, ref_opt = make_optimizer(wd_group), make_optimizer(wd_group)
    ours = OptimizerParamScheduler(ours_opt, **args)
    ref = MCoreScheduler(ref_opt, **args)
    return ours, ours_opt, ref, ref_opt


def assert_groups_match(ours_opt, ref_opt, where: str) -> None:
    for i, (g, r) in enumerate(zip(ours_opt.param_groups, ref_opt.param_groups)):
        assert g["lr"] == pytest.approx(r["lr"], rel=1e-12, abs=1e-18), f"lr group {i} {where}"
        assert g["weight_decay"] == pytest.approx(r["weight_decay"], rel=1e-12, abs=1e-18), f"wd group {i} {where}"


def run_and_compare(ours, ours_opt, ref, ref_opt, n_iters: int = 120) -> list[float]:
    assert_groups_match(ours_opt, ref_opt, "at step 0")
    lrs = []
    # Mostly full batches, with a few odd increments (rampup / partial batches).
    increments = [GBS] * n_iters + [3, 5, 1]
    for it, inc in enumerate(increments):
        ours.step(inc)
        ref.step(inc)
        assert ours.num_steps == ref.num_steps
        assert_groups_match(ours_opt, ref_opt, f"after iteration {it}")
        assert ours.get_wd() == pytest.approx(ref.get_wd(), rel=1e-12)
        lrs.append(ours_opt.param_groups[0]["lr"])
    return lrs


@pytest.mark.parametrize("style", ["constant", "linear", "cosine", "inverse-square-root"])
@pytest.mark.parametrize("warmup_iters,init_lr", [(0, 0.0), (10, 0.0), (10, 1e-5)])
def test_lr_decay_styles_match_megatron(style, warmup_iters, init_lr):
    pair = build_pair(lr_decay_style=style, lr_warmup_steps=warmup_iters * GBS, init_lr=init_lr)
    lrs = run_and_compare(*pair)
    # The schedule actually moves (guards against comparing two constant sequences).
    if style != "constant":
        assert len(set(lrs)) > 10
    elif warmup_iters:
        assert len(set(lrs)) == warmup_iters  # warmup values, then max_lr


@pytest.mark.parametrize("wsd_style", ["exponential", "linear", "cosine", "minus_sqrt"])
def test_wsd_styles_match_megatron(wsd_style):
    ours, ours_opt, ref, ref_opt = build_pair(
        lr_decay_style="WSD", wsd_decay_steps=30 * GBS, lr_wsd_decay_style=wsd_style, init_lr=1e-5
    )
    lrs = run_and_compare(ours, ours_opt, ref, ref_opt)
    # Stable phase at max_lr, then annealing to min_lr at the end of decay.
    assert lrs[40] == pytest.approx(1e-3)
    assert lrs[99] == pytest.approx(1e-4)


@pytest.mark.parametrize("wd_style,start,end", [("constant", 0.1, 0.1), ("linear", 0.0, 0.1), ("cosine", 0.01, 0.1)])
def test_weight_decay_incr_styles_match_megatron(wd_style, start, end):
    ours, ours_opt, ref, ref_opt = build_pair(
        lr_decay_style="cosine", start_wd=start, end_wd=end, wd_incr_style=wd_style, wd_incr_steps=80 * GBS
    )
    run_and_compare(ours, ours_opt, ref, ref_opt)


def test_formulas_written_out():
    """Independent of megatron-core: a few points of the reference §3 formulas."""
    opt = make_optimizer()
    s = OptimizerParamScheduler(opt, **{**BASE, "lr_decay_style": "cosine", "init_lr": 1e-5})
    s.step(5 * GBS)  # half of warmup
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-5 + (1e-3 - 1e-5) * 0.5)
    s.step(50 * GBS)  # n = 55 iters: r = 45/90 = 0.5 -> cosine coeff 0.5
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-4 + 0.5 * (1e-3 - 1e-4))
    assert opt.param_groups[3]["lr"] == pytest.approx(2e-4 + 0.5 * (2e-3 - 2e-4))
    assert opt.param_groups[1]["weight_decay"] == 0.0
    assert opt.param_groups[2]["weight_decay"] == pytest.approx(0.05)
    s.step(100 * GBS)  # past the end of decay
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-4)


# ---------------------------------------------------------------------------- state dict and override rules
def _advanced_pair(n: int = 37, **kwargs):
    ours, ours_opt, ref, ref_opt = build_pair(lr_decay_style="cosine", **kwargs)
    for _ in range(n):
        ours.step(GBS)
        ref.step(GBS)
    return ours, ref


def test_state_dict_keys_and_values_match_megatron():
    ours, ref = _advanced_pair(wd_incr_style="linear", start_wd=0.0, end_wd=0.1)
    assert ours.state_dict() == ref.state_dict()
    assert set(ours.state_dict()) == {
        "max_lr", "lr_warmup_steps", "num_steps", "lr_decay_style", "lr_decay_steps",
        "min_lr", "start_wd", "end_wd", "wd_incr_style", "wd_incr_steps",
    }


@pytest.mark.parametrize("use_ckpt", [False, True])
def test_round_trip_resumes_schedule(use_ckpt):
    ours, ref = _advanced_pair()
    sd = ours.state_dict()
    fresh_opt, ref_opt = make_optimizer(), make_optimizer()
    args = {**BASE, "lr_decay_style": "cosine"}
    fresh = OptimizerParamScheduler(fresh_opt, **args, use_checkpoint_opt_param_scheduler=use_ckpt)
    ref_fresh = MCoreScheduler(ref_opt, **args, use_checkpoint_opt_param_scheduler=use_ckpt)
    fresh.load_state_dict(dict(sd))
    ref_fresh.load_state_dict(dict(sd))
    assert fresh.num_steps == 37 * GBS
    assert_groups_match(fresh_opt, ref_opt, "after load")
    for _ in range(80):
        fresh.step(GBS)
        ref_fresh.step(GBS)
        ours.step(GBS)
        assert_groups_match(fresh_opt, ref_opt, "after resume")
        assert fresh_opt.param_groups[0]["lr"] == ours.optimizer.param_groups[0]["lr"]


def _changed_args():
    return {
        **BASE,
        "lr_decay_style": "linear",
        "max_lr": 5e-4,
        "min_lr": 5e-5,
        "lr_warmup_steps": 4 * GBS,
        "lr_decay_steps": 60 * GBS,
        "start_wd": 0.0,
        "end_wd": 0.2,
        "wd_incr_style": "cosine",
        "wd_incr_steps": 50 * GBS,
    }


@pytest.mark.parametrize("mode", ["use_checkpoint", "override"])
def test_use_checkpoint_and_override_rules_match_megatron(mode):
    ours, _ = _advanced_pair()
    sd = ours.state_dict()
    flags = {
        "use_checkpoint_opt_param_scheduler": mode == "use_checkpoint",
        "override_opt_param_scheduler": mode == "override",
    }
    new_opt, ref_opt = make_optimizer(), make_optimizer()
    new = OptimizerParamScheduler(new_opt, **_changed_args(), **flags)
    ref = MCoreScheduler(ref_opt, **_changed_args(), **flags)
    new.load_state_dict(dict(sd))
    ref.load_state_dict(dict(sd))
    assert new.state_dict() == ref.state_dict()
    if mode == "use_checkpoint":
        assert new.max_lr == 1e-3 and new.lr_decay_style == "cosine" and new.wd_incr_style == "constant"
    else:
        assert new.max_lr == 5e-4 and new.lr_decay_style == "linear" and new.wd_incr_style == "cosine"
    assert new.num_steps == 37 * GBS  # the position always comes from the checkpoint
    for _ in range(50):
        new.step(GBS)
        ref.step(GBS)
        assert_groups_match(new_opt, ref_opt, mode)


def test_mismatch_without_flags_is_a_checkpoint_error():
    ours, _ = _advanced_pair()
    sd = ours.state_dict()
    args = {**BASE, "lr_decay_style": "cosine", "max_lr": 2e-3}
    flags = {"use_checkpoint_opt_param_scheduler": False, "override_opt_param_scheduler": False}
    new = OptimizerParamScheduler(make_optimizer(), **args, **flags)
    with pytest.raises(CheckpointError, match="learning rate"):
        new.load_state_dict(dict(sd))
    ref = MCoreScheduler(make_optimizer(), **args, **flags)
    with pytest.raises(AssertionError):
        ref.load_state_dict(dict(sd))


def test_legacy_key_names_load_like_megatron():
    ours, _ = _advanced_pair()
    sd = ours.state_dict()
    legacy = {
        "start_lr": sd["max_lr"], "min_lr": sd["min_lr"], "warmup_iter": sd["lr_warmup_steps"],
        "end_iter": sd["lr_decay_steps"], "decay_style": sd["lr_decay_style"], "num_iters": sd["num_steps"],
    }
    new_opt, ref_opt = make_optimizer(), make_optimizer()
    new = OptimizerParamScheduler(new_opt, **{**BASE, "lr_decay_style": "cosine"})
    ref = MCoreScheduler(ref_opt, **{**BASE, "lr_decay_style": "cosine"})
    new.load_state_dict(dict(legacy))
    ref.load_state_dict(dict(legacy))
    assert new.num_steps == sd["num_steps"]
    assert_groups_match(new_opt, ref_opt, "legacy load")


def test_both_flags_and_bad_values_raise_config_error():
    with pytest.raises(ConfigError, match="override_opt_param_scheduler"):
        OptimizerParamScheduler(make_optimizer(), **BASE, override_opt_param_scheduler=True)
    # The message names the fields a user sets (lr_warmup_steps is derived from them).
    with pytest.raises(ConfigError, match=r"warmup \(\d+ samples\) is not shorter than the decay .*lr_warmup_iters"):
        OptimizerParamScheduler(make_optimizer(), **{**BASE, "lr_warmup_steps": 100 * GBS})
    with pytest.raises(ConfigError, match="lr_decay_style"):
        OptimizerParamScheduler(make_optimizer(), **{**BASE, "lr_decay_style": "step"})
    with pytest.raises(ConfigError, match="lr_wsd_decay_iters"):
        OptimizerParamScheduler(make_optimizer(), **{**BASE, "lr_decay_style": "WSD"})
    with pytest.raises(ConfigError, match="min_lr"):
        OptimizerParamScheduler(make_optimizer(), **{**BASE, "min_lr": 2e-3})
    with pytest.raises(ConfigError, match="weight_decay_incr_style"):
        OptimizerParamScheduler(make_optimizer(), **{**BASE, "start_wd": 0.0})


# ---------------------------------------------------------------------------- building from configs
def _sched_cfg(**kw) -> SchedulerConfig:
    derived = {name: kw.pop(name) for name in ("lr_warmup_steps", "lr_decay_steps", "wd_incr_steps",
                                               "wsd_decay_steps") if name in kw}
    cfg = SchedulerConfig(**{"lr_decay_style": "cosine", **kw})
    for name, value in derived.items():  # derived fields: set by validate(), not constructor arguments
        setattr(cfg, name, value)
    return cfg


def test_get_optimizer_param_scheduler_uses_derived_steps():
    sched_cfg = _sched_cfg(
        lr_warmup_steps=16, lr_decay_steps=400, wd_incr_steps=480, wsd_decay_steps=None, lr_warmup_init=1e-6
    )
    opt_cfg = OptimizerConfig(lr=3e-4, min_lr=3e-5, weight_decay=0.05)
    train_cfg = TrainingConfig(train_iters=60, global_batch_size=8)
    opt = make_optimizer()
    s = get_optimizer_param_scheduler(opt, sched_cfg, train_cfg, opt_cfg)
    assert (s.lr_warmup_steps, s.lr_decay_steps, s.wd_incr_steps) == (16, 400, 480)
    assert (s.init_lr, s.max_lr, s.min_lr) == (1e-6, 3e-4, 3e-5)
    assert (s.start_wd, s.end_wd) == (0.05, 0.05)  # default to optimizer.weight_decay
    assert s.use_checkpoint_opt_param_scheduler is False
    ref_opt = make_optimizer()
    ref = MCoreScheduler(
        ref_opt, init_lr=1e-6, max_lr=3e-4, min_lr=3e-5, lr_warmup_steps=16, lr_decay_steps=400,
        lr_decay_style="cosine", start_wd=0.05, end_wd=0.05, wd_incr_steps=480, wd_incr_style="constant",
    )
    for _ in range(70):
        s.step(8)
        ref.step(8)
        assert_groups_match(opt, ref_opt, "from config")


def test_get_optimizer_param_scheduler_derives_missing_steps_from_iterations():
    train_cfg = TrainingConfig(train_iters=50, global_batch_size=4)
    opt_cfg = OptimizerConfig(lr=1e-3, min_lr=0.0, weight_decay=0.1)
    s = get_optimizer_param_scheduler(
        make_optimizer(),
        _sched_cfg(lr_decay_style="WSD", lr_wsd_decay_iters=10, lr_warmup_fraction=0.1, lr_decay_iters=40,
                   start_weight_decay=0.0, weight_decay_incr_style="linear"),
        train_cfg,
        opt_cfg,
    )
    assert s.lr_decay_steps == 40 * 4
    assert s.wd_incr_steps == 50 * 4
    assert s.wsd_decay_steps == 10 * 4
    assert s.lr_warmup_steps == pytest.approx(0.1 * 160)
    assert (s.start_wd, s.end_wd) == (0.0, 0.1)
    s2 = get_optimizer_param_scheduler(
        make_optimizer(), _sched_cfg(lr_warmup_iters=3), train_cfg, opt_cfg
    )
    assert (s2.lr_warmup_steps, s2.lr_decay_steps) == (12, 200)
    with pytest.raises(ConfigError, match="train_iters"):
        get_optimizer_param_scheduler(
            make_optimizer(), _sched_cfg(), TrainingConfig(global_batch_size=4), opt_cfg
        )


def test_cosine_weight_decay_formula():
    """wd cosine increment written out: start + 0.5(cos(pi(1-r))+1)(end-start)."""
    opt = make_optimizer(wd_override_group=True)
    s = OptimizerParamScheduler(opt, **{**BASE, "start_wd": 0.0, "end_wd": 0.2, "wd_incr_style": "cosine"})
    s.step(25 * GBS)
    r = 0.25
    assert opt.param_groups[0]["weight_decay"] == pytest.approx(0.2 * 0.5 * (math.cos(math.pi * (1 - r)) + 1))
    # The last group has its own end points start_wd=0, end_wd=0.3.
    assert opt.param_groups[-1]["weight_decay"] == pytest.approx(0.3 * 0.5 * (math.cos(math.pi * (1 - r)) + 1))
