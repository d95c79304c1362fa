"""Optimizer CPU offload (optimizer.optimizer_cpu_offload, optimizer_offload_fraction): the offloaded part's
state lives on separate host copies and steps there, and the updates equal the plain optimizer's; its state
dict is the plain optimizer's (checkpoints load either way); a training run's losses match, and a resume from a
checkpoint written with offload is bit-exact; under FSDP2 each rank offloads its shards and the losses match."""

from __future__ import annotations

import copy

import pytest
import torch

from longspan.training.optim.cpu_offload import CpuOffloadOptimizer, offloaded_parameters
from longspan.training.optim.optimizer import get_megatron_optimizer
from tests.training.pretrain_helpers import losses_by_iteration, tiniest_config
from tests.parallel.conftest import pool2  # noqa: F401 - the 2-process pool
from tests.training.test_optimizer import fill_grads, opt_config, tiny

OFFLOAD = dict(optimizer_cpu_offload=True, optimizer_offload_fraction=0.5, pin_cpu_params=True, pin_cpu_grads=True,
               overlap_cpu_optimizer_d2h_h2d=False)


def _steps(opt, model, first_seed: int, count: int) -> None:
    for seed in range(first_seed, first_seed + count):
        fill_grads(model, seed)
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("kind", [dict(), dict(bf16=True), dict(optimizer="sgd")], ids=["adamw", "bf16", "sgd"])
def test_offloaded_part_steps_on_host_copies_and_matches_the_plain_optimizer(kind) -> None:
    model = tiny().to(torch.bfloat16) if kind.get("bf16") else tiny()
    plain_model = copy.deepcopy(model)
    opt = get_megatron_optimizer(opt_config(**kind, **OFFLOAD), [model])
    plain = get_megatron_optimizer(opt_config(**kind), [plain_model])
    _steps(opt, model, 0, 3)
    _steps(plain, plain_model, 0, 3)

    inner = opt.optimizer
    assert isinstance(inner, CpuOffloadOptimizer) and inner.host_steps == 3
    params = opt.get_parameters()
    offloaded = offloaded_parameters(params, 0.5)
    assert set(inner.host_copy) == set(offloaded) and 0 < len(offloaded) < len(params)
    assert sum(p.numel() for p in offloaded) >= 0.5 * sum(p.numel() for p in params)
    for param in params:
        if kind.get("optimizer") == "sgd":
            entries = [v for v in opt.state[param].values() if isinstance(v, torch.Tensor) and v.dim()]
        else:
            entries = [opt.state[param]["exp_avg"], opt.state[param]["exp_avg_sq"]]
        host = inner.host_copy.get(param)
        if host is None:  # the device part's own state
            assert inner.device_optimizer.state[param] is opt.state[param]
            continue
        # the state sits with the host copy, a tensor of its own (not the parameter's storage)
        assert inner.host_optimizer.state[host] is opt.state[param]
        assert host.data_ptr() != param.data_ptr() and torch.equal(host, param.float())
        assert all(e.device.type == "cpu" for e in entries)
    for a, b in zip(model.parameters(), plain_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=0)


def test_state_dict_is_the_plain_optimizers_and_loads_either_way() -> None:
    model = tiny()
    opt = get_megatron_optimizer(opt_config(**OFFLOAD), [model])
    _steps(opt, model, 0, 2)
    # offloaded -> plain, and plain -> offloaded: the next steps agree
    plain_model, back_model = copy.deepcopy(model), copy.deepcopy(model)
    plain = get_megatron_optimizer(opt_config(), [plain_model])
    plain.load_state_dict(copy.deepcopy(opt.state_dict()))
    back = get_megatron_optimizer(opt_config(**OFFLOAD), [back_model])
    back.load_state_dict(copy.deepcopy(plain.state_dict()))
    for o, m in ((opt, model), (plain, plain_model), (back, back_model)):
        _steps(o, m, 2, 2)
    for a, b, c in zip(model.parameters(), plain_model.parameters(), back_model.parameters()):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert all(v.device.type == "cpu" for h in back.optimizer.host_copy.values()
               for v in back.optimizer.host_optimizer.state[h].values())


def test_parameters_written_outside_the_optimizer_reach_the_host_copies() -> None:
    model, plain_model = tiny(), tiny()
    opt = get_megatron_optimizer(opt_config(**OFFLOAD), [model])
    plain = get_megatron_optimizer(opt_config(), [plain_model])
    _steps(opt, model, 0, 1)
    _steps(plain, plain_model, 0, 1)
    with torch.no_grad():  # e.g. weights loaded from a checkpoint without the optimizer state
        for a, b in zip(model.parameters(), plain_model.parameters()):
            a.mul_(0.5)
            b.mul_(0.5)
    _steps(opt, model, 1, 1)
    _steps(plain, plain_model, 1, 1)
    for a, b in zip(model.parameters(), plain_model.parameters()):
        assert torch.equal(a, b)


def _run(tmp_path, name: str, **optimizer):
    cfg = tiniest_config(tmp_path, name, train_iters=4)
    for key, value in optimizer.items():
        setattr(cfg.optimizer, key, value)
    return cfg


def test_training_losses_equal_the_plain_optimizer_and_resume_bit_exact(tmp_path) -> None:
    from longspan.training.pretrain import pretrain

    plain = _run(tmp_path, "plain")
    pretrain(plain)
    offload = _run(tmp_path, "offload", optimizer_cpu_offload=True, optimizer_offload_fraction=0.6)
    offload.checkpoint.save_interval = 2
    pretrain(offload)
    want, got = losses_by_iteration(plain), losses_by_iteration(offload)
    assert sorted(got) == [1, 2, 3, 4]
    for it in want:
        assert abs(got[it] - want[it]) <= 1e-5 * abs(want[it])
    # resume from the offloaded optimizer's checkpoint of iteration 2 (DCP, name-keyed state)
    resumed = _run(tmp_path, "resumed", optimizer_cpu_offload=True, optimizer_offload_fraction=0.6)
    resumed.checkpoint.load = offload.checkpoint.save
    resumed.checkpoint.ckpt_step = 2
    resumed.checkpoint.save = None
    pretrain(resumed)
    again = losses_by_iteration(resumed)
    assert sorted(again) == [3, 4] and all(again[it] == got[it] for it in (3, 4))


def test_planner_moves_the_offloaded_state_to_the_host(tmp_path) -> None:
    from longspan.planner.plan import Layout, PlanRow, estimate_memory, format_table

    def memory(**optimizer_fields):
        cfg = tiniest_config(tmp_path, train_iters=2)
        cfg.model.vocab_size = 64
        for name, value in optimizer_fields.items():
            setattr(cfg.optimizer, name, value)
        cfg.validate(world_size=1)
        return estimate_memory(cfg, Layout(world_size=1))

    plain, offload = memory(), memory(optimizer_cpu_offload=True, optimizer_offload_fraction=0.25)
    params = plain.optimizer / 8  # Adam: two fp32 moments per parameter
    assert offload.optimizer == pytest.approx(plain.optimizer * 0.75)
    assert offload.host == pytest.approx(params * 0.25 * (8 + 4 + 4)) and plain.host == 0.0
    assert offload.peak < plain.peak
    row = PlanRow(Layout(world_size=1), "none", offload, 1.0, 1.0)
    assert "optimizer CPU offload: up to" in format_table([row], 2**40)


@pytest.mark.parametrize("fields, message", [
    ({"optimizer_offload_fraction": 0.5}, "optimizer.optimizer_offload_fraction=0.5 needs optimizer.optimizer_cpu_offload=True"),
    ({"optimizer_cpu_offload": True}, "optimizer_offload_fraction=0.0 offloads nothing"),
    ({"optimizer_cpu_offload": True, "optimizer_offload_fraction": 0.5, "use_precision_aware_optimizer": True,
      "use_distributed_optimizer": True},
     "not supported yet with optimizer.use_precision_aware_optimizer=True"),
], ids=["fraction-alone", "nothing-offloaded", "precision-aware"])
def test_offload_settings_that_cannot_work_are_one_line_errors(tmp_path, fields, message) -> None:
    from longspan.core.errors import ConfigError

    cfg = tiniest_config(tmp_path, train_iters=2)
    for name, value in fields.items():
        setattr(cfg.optimizer, name, value)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        cfg.validate(world_size=1)



def _fsdp2_offload_case() -> dict:
    """Two FSDP2 models of the same initial weights on this rank's mesh, one with half its optimizer offloaded:
    per-iteration losses of each, and where the offloaded state lives."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from torch.distributed.tensor import DTensor

    from longspan.models.gpt import build_gpt_model, init_weights
    from longspan.parallel.parallelize import parallelize_model
    from tests.parallel.layout_training import build_layout_model, train_on_global_batches
    from tests.parallel.test_layout_parity import GBS, MBS, global_batches, tiny_config

    cfg = tiny_config(fsdp2=True, seq=16)
    parallel, model, optimizer = build_layout_model(cfg)
    cfg.optimizer.optimizer_cpu_offload, cfg.optimizer.optimizer_offload_fraction = True, 0.5
    offload_model = parallelize_model(build_gpt_model(cfg.model, materialize=False), cfg, parallel)
    init_weights(offload_model, seed=cfg.rng.seed, device=parallel.device)
    offload_model.train()
    offload = get_megatron_optimizer(cfg.optimizer, [offload_model])
    batches = global_batches(2, seq=cfg.model.seq_length)
    plain_losses, _ = train_on_global_batches(model, optimizer, parallel, batches, GBS, MBS)
    offload_losses, _ = train_on_global_batches(offload_model, offload, parallel, batches, GBS, MBS)
    inner = offload.optimizer
    param, host = next(iter(inner.host_copy.items()))
    saved = get_optimizer_state_dict(offload_model, inner)["state"]
    before = inner.host_optimizer.state[host]["exp_avg"].clone()
    inner.load_state_dict(copy.deepcopy(inner.state_dict()))  # sharded state back into the host part
    reloaded = inner.host_optimizer.state[host]["exp_avg"]
    return {
        "reloaded": not isinstance(reloaded, DTensor) and reloaded.device.type == "cpu" and torch.equal(reloaded, before),
        "plain": plain_losses, "offload": offload_losses, "host_steps": inner.host_steps,
        "sharded": isinstance(param, DTensor) and host.shape == param.to_local().shape != param.shape,
        "state_on_host": all(v.to_local().device.type == "cpu" and v.to_local().data_ptr() == host_state.data_ptr()
                             for v, host_state in ((offload.state[param][k], inner.host_optimizer.state[host][k])
                                                   for k in ("exp_avg", "exp_avg_sq"))),
        "saved_sharded": all(isinstance(v["exp_avg"], DTensor) for v in saved.values()),
    }


@pytest.mark.slow
def test_fsdp2_shards_offload_and_match_the_plain_optimizer(pool2) -> None:  # noqa: F811 - the pool fixture
    for r in pool2.run(_fsdp2_offload_case, timeout=240):
        assert r["host_steps"] == 2 and r["sharded"] and r["state_on_host"]
        assert r["saved_sharded"] and r["reloaded"]
        for got, want in zip(r["offload"], r["plain"]):
            assert abs(got - want) <= 1e-5 * abs(want)
