"""Seed 003 (longspan.training.utils.train_utils): every name, with expected values from independent oracles
(formulas written out here, torch.norm of concatenated tensors, TensorBoard's own event reader)."""

from __future__ import annotations

import functools
import inspect
import json
import math
import os
import re
import time
from datetime import datetime
from types import SimpleNamespace as NS

import pytest
import torch
import torch.nn as nn

from longspan.config.schema.container import ConfigContainer
from longspan.config.schema.optim import OptimizerConfig
from longspan.config.schema.training import CheckpointConfig, LoggerConfig, TrainingConfig
from longspan.core.errors import ConfigError
from longspan.models.gpt_provider import GPTModelProvider
from longspan.training.observability import profiling
from longspan.training.state import GlobalState, TrainState
from longspan.training.observability import log_line
from longspan.training.utils import train_utils as tu
from longspan.training.observability.progress_log import (
    append_to_progress_log,
    format_saved_checkpoint_message,
    parse_progress_log,
)
from tests.parallel.harness import free_port

SEED_003_NAMES = {
    "LinearForLastLayer": ["self", "input_size", "output_size", "sequence_parallel"],
    "create_value_head_hook": ["hidden_size", "sequence_parallel", "output_size"],
    "make_value_model": ["hidden_size", "sequence_parallel"],
    "freeze_moe_router": ["model"],
    "_ensure_model_list": ["model"],
    "_freeze_parameter_if_present": ["module", "name"],
    "_register_linear_for_last_layer_mapping": [],
    "start_memory_history_recording": ["profiling"],
    "param_is_not_shared": ["param"],
    "calc_params_l2_norm": ["model", "model_config", "use_megatron_fsdp", "force_create_fp32_copy"],
    "calc_dtensor_params_l2_norm": ["params"],
    "reduce_max_stat_across_model_parallel_group": ["stat", "mp_group"],
    "logical_and_across_model_parallel_group": ["input", "mp_group"],
    "reduce_max_memory_across_pp_group": ["memory_report", "pp_group"],
    "_MoeMetricFanoutWriter": ["self", "tb_writer", "comet_logger", "mlflow_logger"],
    "_build_moe_metric_writer": ["tb_writer", "comet_logger", "mlflow_logger"],
    "training_log": [
        "loss_dict", "total_loss_dict", "learning_rate", "decoupled_learning_rate", "loss_scale",
        "report_memory_flag", "skipped_iter", "grad_norm", "params_norm", "num_zeros_in_grad", "config",
        "global_state", "history_wct", "model", "pg_collection", "log_max_attention_logit", "loaded_iteration",
        "seq_length",
    ],
    "report_memory": ["memory_keys"],
    "report_l2_norm_grad": ["model"],
    "report_runtime": ["train_state", "start_time", "seq_length", "train_iters", "time_unit"],
    "report_throughput": ["train_config", "iteration", "seq_length", "history_wct", "window_size"],
    "prepare_forward_step_func": ["forward_step_func", "state"],
    "needs_global_state_injection": ["forward_step_func"],
    "maybe_inject_state": ["forward_step_func", "state", "needs_injection"],
}


def test_every_seed_003_name_with_its_parameters():
    for name, params in SEED_003_NAMES.items():
        obj = getattr(tu, name)
        target = obj.__init__ if inspect.isclass(obj) else obj
        assert list(inspect.signature(target).parameters) == params, name
    assert isinstance(tu.MEMORY_KEYS, dict) and tu.MEMORY_KEYS["allocated_bytes.all.current"] == "mem-allocated-bytes"
    assert tu.ModelList is not None and tu.ModelHook is not None
    assert inspect.signature(tu.report_runtime).parameters["time_unit"].default == "seconds"
    assert inspect.signature(tu.create_value_head_hook).parameters["output_size"].default == 1


# ---------------------------------------------------------------------------------------------- fixtures
def make_cfg(tmp_path, **logger):
    base = dict(
        log_interval=2, log_params_norm=False, log_throughput=True, log_progress=False, timing_log_level=0,
        timing_log_option="minmax", tensorboard_dir=str(tmp_path / "tb") if tmp_path else None,
        tensorboard_log_interval=1,
        tensorboard_queue_size=10, log_timers_to_tensorboard=True, log_loss_scale_to_tensorboard=True,
        log_validation_ppl_to_tensorboard=True, log_memory_to_tensorboard=False, log_world_size_to_tensorboard=True,
        wandb_project=None,
    )
    base.update(logger)
    return ConfigContainer(
        logger=LoggerConfig(**base),
        train=TrainingConfig(train_iters=10, global_batch_size=8, micro_batch_size=2),
        model=GPTModelProvider(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                               kv_channels=16, ffn_hidden_size=128, gated_linear_unit=True, vocab_size=256,
                               seq_length=32),
        checkpoint=CheckpointConfig(save=None), optimizer=OptimizerConfig(decoupled_lr=None),
    )


def read_scalars(tb_dir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    ea.Reload()
    return {tag: [(e.step, e.value) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}


def step(state, cfg, total, loss_dict, *, skipped=0, grad_norm=1.25, params_norm=None, num_zeros=None, flag=True, wct=None,
         model=()):
    """One iteration of the trainer's bookkeeping followed by training_log."""
    ts = state.train_state
    ts.step += 1
    ts.consumed_train_samples += cfg.train.global_batch_size
    wct.append(time.time())
    return tu.training_log(loss_dict, total, 2.5e-4, None, 4096.0, flag, skipped, grad_norm, params_norm,
                           num_zeros, cfg, state, wct, list(model))


# §4, field by field: widths 8/8, 12, 5, 3/3; formats .1f, .6E, .3f.
LINE_RE = re.compile(
    r"^ \[(?P<stamp>\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2})\]"
    r" iteration (?P<it>[ \d]{8})/(?P<iters>[ \d]{8}) \|"
    r" consumed samples: (?P<consumed>[ \d]{12}) \|"
    r" elapsed time per iteration \(ms\): (?P<ms>\d+\.\d) \|"
    r" throughput per GPU \(TFLOP/s/GPU\): (?P<tput>\d+\.\d) \|"
    r"( MFU: ((?P<mfu>\d+\.\d)%|n/a \(peak too low\)) \|)?"  # n/a: these fake timings beat the CPU's peak
    r" learning rate: (?P<lr>\d\.\d{6}E[+-]\d\d) \|"
    r" global batch size: (?P<gbs>[ \d]{5}) \|"
    r" lm loss: (?P<loss>\d\.\d{6}E[+-]\d\d) \|"
    r" loss scale: (?P<scale>\d+\.\d) \|"
    r" grad norm: (?P<gnorm>\d+\.\d{3}) \|"
    r" number of skipped iterations: (?P<skipped>[ \d]{3}) \|"
    r" number of nan iterations: (?P<nan>[ \d]{3}) \|$"
)


def _lines(captured):
    return [r for r in captured if " iteration " in r and "consumed samples" in r]


# ---------------------------------------------------------------------------------------------- training_log
def test_line_format_and_interval_average(tmp_path, captured):
    cfg = make_cfg(tmp_path, tensorboard_dir=None)
    state = GlobalState(cfg)
    total, wct = {}, []
    # one loss value per iteration in each accepted form: float, 0-d tensor, [sum, count]
    step(state, cfg, total, {"lm loss": 2.0}, wct=wct)
    state.timers("interval-time", log_level=0).set_elapsed(3.0)
    step(state, cfg, total, {"lm loss": torch.tensor([9.0, 3.0])}, wct=wct)
    step(state, cfg, total, {"lm loss": torch.tensor(5.0)}, wct=wct)
    step(state, cfg, total, {"lm loss": torch.tensor(1.0)}, wct=wct)
    lines = _lines(captured)
    assert len(lines) == 2
    m = LINE_RE.match(lines[0])
    assert m, lines[0]
    datetime.strptime(m["stamp"], "%Y-%m-%d %H:%M:%S")
    assert m["it"] == "       2" and m["iters"] == "      10"
    assert m["consumed"] == " " * 10 + "16"
    assert m["ms"] == "1500.0"  # 3 s over 2 iterations
    # the trainer kept no FLOPs total here: the formula times 2 iterations, over 3 s, on 1 GPU
    assert m["tput"] == f"{2 * FLOPS_PER_ITER / 3.0 / 1e12:.1f}"
    assert m["lr"] == "2.500000E-04" and m["gbs"] == "    8"
    assert m["loss"] == "2.500000E+00"  # (2 + 9/3) / 2
    assert m["scale"] == "4096.0" and m["gnorm"] == "1.250" and m["skipped"] == "  0" and m["nan"] == "  0"
    m2 = LINE_RE.match(lines[1])
    assert m2 and m2["loss"] == "3.000000E+00"  # (5 + 1) / 2: the interval's accumulators were reset


def test_skipped_and_nan_iterations(tmp_path, captured):
    cfg = make_cfg(tmp_path, tensorboard_dir=None, log_interval=4)
    state = GlobalState(cfg)
    total, wct = {}, []
    step(state, cfg, total, {"lm loss": 4.0}, wct=wct)
    step(state, cfg, total, {"lm loss": torch.tensor(float("nan"))}, skipped=1, wct=wct)
    step(state, cfg, total, {"lm loss": 100.0}, skipped=1, wct=wct)  # skipped: not averaged in, not nan
    step(state, cfg, total, {"lm loss": torch.tensor([12.0, 2.0])}, wct=wct)
    step(state, cfg, total, {"lm loss": 1.0}, wct=wct)
    for _ in range(3):
        step(state, cfg, total, {"lm loss": 1.0}, wct=wct)
    lines = _lines(captured)
    m = LINE_RE.match(lines[0])
    assert m, lines[0]
    assert m["loss"] == "5.000000E+00"  # (4 + 6) / 2 advanced iterations
    assert m["skipped"] == "  2" and m["nan"] == "  1"
    m = LINE_RE.match(lines[1])
    assert m and m["skipped"] == "  0" and m["nan"] == "  0" and m["loss"] == "1.000000E+00"


def test_optional_fields_and_negative_losses(tmp_path, captured):
    cfg = make_cfg(tmp_path, tensorboard_dir=None, log_interval=1, log_throughput=False)
    state = GlobalState(cfg)
    state.train_state.skipped_train_samples = 3
    tu.training_log({"lm loss": 1.0, "reward": -2.0}, {}, 1e-3, None, 1.0, False, 0, None, 12.5, 7, cfg, state,
                    [0.0, 1.0], [], log_max_attention_logit=30.0)
    (line,) = _lines(captured)
    assert "throughput" not in line and "grad norm" not in line and "reward" not in line
    assert " skipped samples:            3 |" in line
    assert line.endswith(
        "| lm loss: 1.000000E+00 | loss scale: 1.0 | num zeros: 7 | params norm: 12.500 | "
        "max attention logit: 30.000 | number of skipped iterations:   0 | number of nan iterations:   0 |"
    )


def test_timers_are_logged_and_written(tmp_path, captured):
    cfg = make_cfg(tmp_path, timing_log_level=1)
    state = GlobalState(cfg)
    total, wct = {}, []
    for _ in range(2):
        state.timers("forward-backward", log_level=1).set_elapsed(0.25)
        step(state, cfg, total, {"lm loss": 1.0}, wct=wct)
    state.close_loggers()
    timer_reports = [r for r in captured if r.startswith("time (ms):")]
    # the second set_elapsed overwrote the first: 0.25 s over log_interval=2 iterations = 125 ms
    assert timer_reports == ["time (ms):\n    " + "forward-backward ".ljust(48, ".") + ": 125.00"]
    assert not any("across ranks" in r for r in captured)  # one process: no ranks to compare
    scalars = read_scalars(tmp_path / "tb")
    assert scalars["forward-backward-time"] == [(1, 0.25), (2, 0.125)]


def test_report_memory_flag(tmp_path, monkeypatch, captured):
    cfg = make_cfg(tmp_path, tensorboard_dir=None, log_interval=1)
    monkeypatch.setattr(log_line, "report_memory", lambda keys: {"mem-max-allocated-gigabytes": 2.0})
    state = GlobalState(cfg)
    total, wct = {}, []
    assert step(state, cfg, total, {"lm loss": 1.0}, wct=wct) is True
    assert step(state, cfg, total, {"lm loss": 1.0}, wct=wct) is False
    assert "[Rank 0] (after 1 iterations) memory (GB) | mem-max-allocated-gigabytes: 2.0" in captured


# ---------------------------------------------------------------------------------------------- FLOPs
def _matmul_flops(B, s, h, L, heads, groups, d, f, gated_mlp_widths, V):
    """Count every matmul of one training step (2 FLOPs per multiply-add, backward = 2x forward)."""
    q, k = d * heads, d * groups
    per_token = 0
    for f_width, n_mats in gated_mlp_widths:
        per_token += 2 * h * q + 2 * 2 * h * k + 2 * q * h  # q, k, v, out projections
        per_token += n_mats * 2 * h * f_width  # MLP matrices
        per_token += (2 * q * s + 2 * q * s) / 2  # QK^T and AV, causal half
    per_token += 2 * h * V  # logits
    return 3 * B * s * per_token


FLOPS_PER_ITER = _matmul_flops(8, 32, 64, 2, 4, 2, 16, 128, [(128, 3)] * 2, 256)  # make_cfg's model, batch 8


def test_flops_dense_gqa_swiglu():
    cfg = make_cfg(None)
    expected = _matmul_flops(8, 32, 64, 2, 4, 2, 16, 128, [(128, 3)] * 2, 256)
    assert tu.num_floating_point_operations(cfg, 8) == pytest.approx(expected, rel=1e-12)
    cfg.model.gated_linear_unit = False
    expected = _matmul_flops(8, 32, 64, 2, 4, 2, 16, 128, [(128, 2)] * 2, 256)
    assert tu.num_floating_point_operations(cfg, 8) == pytest.approx(expected, rel=1e-12)


def test_flops_defaults_and_moe():
    from longspan.config.schema.container import ConfigContainer
    from longspan.models.gpt_provider import GPTModelProvider

    model = GPTModelProvider(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=250,
                             make_vocab_size_divisible_by=128, seq_length=16, num_moe_experts=4, moe_router_topk=2,
                             moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=16, moe_layer_freq=[1, 0],
                             gated_linear_unit=True, ffn_hidden_size=256)
    cfg = ConfigContainer(model=model)
    # defaults: groups = heads, kv_channels = h / heads, ffn = 4h, vocab padded to 256
    expected = _matmul_flops(2, 16, 64, 2, 4, 4, 16, None, [(2 * 32 + 16, 3), (256, 3)], 256)
    assert tu.num_floating_point_operations(cfg, 2) == pytest.approx(expected, rel=1e-12)


# ---------------------------------------------------------------------------------------------- norms
def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3, bias=False))


def test_params_norm_matches_concatenated_norm():
    m = _model()
    expected = torch.cat([p.detach().flatten().double() for p in m.parameters()]).norm().item()
    assert tu.calc_params_l2_norm(m, NS(bf16=False)) == pytest.approx(expected, rel=1e-6)
    # the same chunk twice (shared module) and a parameter marked shared=True count once
    extra = nn.Linear(7, 3, bias=False)
    extra.weight = m[2].weight
    tied = nn.Module()
    tied.out = nn.Parameter(m[0].weight.detach().clone())
    tied.out.shared = True
    assert tu.calc_params_l2_norm([m, m, extra, tied], NS(bf16=False)) == pytest.approx(expected, rel=1e-6)
    assert tu.param_is_not_shared(m[0].weight) and not tu.param_is_not_shared(tied.out)


def test_params_norm_bf16_and_main_param():
    m = _model().to(torch.bfloat16)
    expected = torch.cat([p.detach().flatten().double() for p in m.parameters()]).norm().item()
    assert tu.calc_params_l2_norm(m, NS(bf16=True)) == pytest.approx(expected, rel=1e-6)
    for p in m.parameters():
        p.main_param = torch.full(p.shape, 2.0)
    n = sum(p.numel() for p in m.parameters())
    assert tu.calc_params_l2_norm(m, NS(bf16=True)) == pytest.approx(2.0 * math.sqrt(n))
    assert tu.calc_params_l2_norm(m, NS(bf16=True), force_create_fp32_copy=True) == pytest.approx(expected, rel=1e-6)
    with pytest.raises(RuntimeError, match="DTensor"):
        tu.calc_params_l2_norm(m, NS(bf16=True), use_megatron_fsdp=True)


def test_report_l2_norm_grad():
    m = _model()
    for i, p in enumerate(m.parameters()):
        p.grad = torch.full_like(p, float(i + 1))
    m[2].weight.main_grad = torch.full_like(m[2].weight, 10.0)
    names = [n for n, _ in m.named_parameters()]
    report = tu.report_l2_norm_grad([m])
    expected = {
        names[0]: 1.0 * math.sqrt(35), names[1]: 2.0 * math.sqrt(7), names[2]: 10.0 * math.sqrt(21),
    }
    for name, value in expected.items():
        assert report[f"l2_norm/grad/{name}"] == pytest.approx(value)
    assert report["l2_norm/grad/global"] == pytest.approx(math.sqrt(sum(v * v for v in expected.values())))


def _dist_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import datetime as _dt

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from longspan.training.observability.timers import Timers

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=_dt.timedelta(seconds=60))
    try:
        mesh = init_device_mesh("cpu", (world,))
        g = torch.Generator().manual_seed(0)
        a, b, c = torch.randn(7, 4, generator=g), torch.randn(5, generator=g), torch.randn(3, generator=g)
        m = nn.Module()
        m.a = nn.Parameter(distribute_tensor(a, mesh, [Shard(0)]))  # uneven: 4 + 3 rows
        m.b = nn.Parameter(distribute_tensor(b, mesh, [Replicate()]))
        m.c = nn.Parameter(c.clone())  # plain, data-parallel replicated
        result = {
            "norm": tu.calc_params_l2_norm(m, NS(bf16=False)),
            "dtensor_norm": tu.calc_dtensor_params_l2_norm([m.a, m.b]),
            "expected": torch.cat([a.flatten(), b, c]).double().norm().item(),
            "expected_dtensor": torch.cat([a.flatten(), b]).double().norm().item(),
            "max_some_none": tu.reduce_max_stat_across_model_parallel_group(None if rank == 0 else 3.0, dist.group.WORLD),
            "max_all_none": tu.reduce_max_stat_across_model_parallel_group(None, dist.group.WORLD),
            "and_mixed": tu.logical_and_across_model_parallel_group(rank == 0, dist.group.WORLD),
            "and_true": tu.logical_and_across_model_parallel_group(True, dist.group.WORLD),
            "memory": tu.reduce_max_memory_across_pp_group({"count": rank + 1, "gb": 0.5 * rank}, dist.group.WORLD),
        }
        timers = Timers(0, "minmax")
        timers("step", log_level=0).set_elapsed(0.1 * (rank + 1))
        result["minmax"] = timers.get_all_timers_string(["step"])
        timers = Timers(0, "all")
        timers("step", log_level=0).set_elapsed(0.1 * (rank + 1))
        result["all"] = timers.get_all_timers_string(["step"])
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_two_rank_dtensor_norms_reductions_and_timers(tmp_path, monkeypatch):
    import torch.multiprocessing as mp

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    # fork: the children reuse the imported modules (spawn would re-import torch twice on a busy machine)
    mp.start_processes(_dist_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True, start_method="fork")
    for rank in range(2):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r["norm"] == pytest.approx(r["expected"], rel=1e-6)
        assert r["dtensor_norm"] == pytest.approx(r["expected_dtensor"], rel=1e-6)
        assert r["max_some_none"] == 3.0 and r["max_all_none"] is None
        assert r["and_mixed"] is False and r["and_true"] is True
        assert r["memory"] == {"count": 2, "gb": 0.5} and isinstance(r["memory"]["count"], int)
        assert r["minmax"] == "(min, max) time across ranks (ms):\n    " + "step ".ljust(48, ".") + ": (100.00, 200.00)"
        assert r["all"] == "times across ranks (ms):\n  step:\n     rank  0: 100.00\n     rank  1: 200.00"


def test_single_process_reductions_are_identity():
    assert tu.reduce_max_stat_across_model_parallel_group(1.5, None) == 1.5
    assert tu.reduce_max_stat_across_model_parallel_group(None, None) is None
    assert tu.logical_and_across_model_parallel_group(False, None) is False
    report = {"a": 1}
    assert tu.reduce_max_memory_across_pp_group(report, None) is report


# ---------------------------------------------------------------------------------------------- state injection
class _State(GlobalState):
    pass


def test_state_injection_cases():
    state = GlobalState()

    def plain(data_iterator, model):
        return "plain", data_iterator, model

    def with_plan(data_iterator, model, return_schedule_plan=False):
        return "plan", data_iterator, model

    def typed(state: GlobalState, data_iterator, model):
        return state, data_iterator, model

    def typed_plan(s: "GlobalState", data_iterator, model, return_schedule_plan=False):
        return s, data_iterator, model

    def named(state, data_iterator, model):
        return state, data_iterator, model

    def named_global(global_state, data_iterator, model):
        return global_state, data_iterator, model

    class Functor:
        def __init__(self):
            self.calls = 0

        def __call__(self, state: GlobalState, data_iterator, model):
            self.calls += 1
            return state, self.calls

    for fn in (plain, with_plan):
        assert not tu.needs_global_state_injection(fn)
        assert tu.maybe_inject_state(fn, state) is fn
        assert tu.prepare_forward_step_func(fn, state) is fn
    for fn in (typed, typed_plan, named, named_global):
        assert tu.needs_global_state_injection(fn)
        wrapped = tu.prepare_forward_step_func(fn, state)
        assert isinstance(wrapped, functools.partial)
        assert wrapped("it", "m") == (state, "it", "m")
    functor = Functor()
    wrapped = tu.prepare_forward_step_func(functor, state)
    assert wrapped("it", "m") == (state, 1) and wrapped("it", "m") == (state, 2) and functor.calls == 2
    # a partial that already bound the state needs nothing more; one that bound something else still does
    assert not tu.needs_global_state_injection(functools.partial(named, state))
    assert tu.needs_global_state_injection(functools.partial(typed, model="m"))
    # explicit needs_injection skips inspection; state changes are visible through the partial
    wrapped = tu.maybe_inject_state(plain, state, needs_injection=True)
    assert wrapped.args == (state,)
    state.train_state.step = 42
    assert tu.prepare_forward_step_func(named, state)("it", "m")[0].train_state.step == 42
    sub = _State()

    def subclass_hint(st: _State, data_iterator, model):
        return st

    assert not tu.needs_global_state_injection(subclass_hint)  # only GlobalState itself (or its name) counts
    assert not tu.needs_global_state_injection(print)  # no signature: left alone
    del sub


# ---------------------------------------------------------------------------------------------- MoE, value heads
class _MLP(nn.Module):
    def __init__(self, megatron_gate: bool):
        super().__init__()
        self.router = nn.Linear(8, 4)
        self.experts = nn.Linear(8, 8)
        self.shared_experts = nn.Module()
        self.shared_experts.fc = nn.Linear(8, 8)
        if megatron_gate:
            self.shared_experts.gate_weight = nn.Parameter(torch.zeros(1, 8))
        else:
            self.shared_experts.gate = nn.Linear(8, 1)


def _moe_model(megatron_gate=False):
    m = nn.Module()
    m.decoder = nn.Module()
    m.decoder.layers = nn.ModuleList([nn.Module(), nn.Module()])
    for layer in m.decoder.layers:
        layer.mlp = _MLP(megatron_gate)
    m.embedding = nn.Embedding(10, 8)
    return m


def test_freeze_moe_router():
    m = _moe_model()
    chunks = tu.freeze_moe_router(m)
    assert chunks == [m]
    frozen = {n for n, p in m.named_parameters() if not p.requires_grad}
    assert frozen == {
        f"decoder.layers.{i}.mlp.{p}" for i in range(2)
        for p in ("router.weight", "router.bias", "shared_experts.gate.weight", "shared_experts.gate.bias")
    }
    m2 = _moe_model(megatron_gate=True)
    assert tu.freeze_moe_router([m2]) == [m2]
    frozen = {n for n, p in m2.named_parameters() if not p.requires_grad}
    assert "decoder.layers.0.mlp.shared_experts.gate_weight" in frozen
    assert "decoder.layers.1.mlp.experts.weight" not in frozen and "embedding.weight" not in frozen


def test_freeze_parameter_helpers():
    lin = nn.Linear(2, 2)
    tu._freeze_parameter_if_present(lin, "bias")
    tu._freeze_parameter_if_present(lin, "missing")
    assert not lin.bias.requires_grad and lin.weight.requires_grad
    assert tu._ensure_model_list(lin) == [lin] and tu._ensure_model_list([lin]) == [lin]


def test_value_head():
    torch.manual_seed(0)
    head = tu.LinearForLastLayer(8, 2, sequence_parallel=False)
    x = torch.randn(3, 5, 8)
    out, bias = head(x, weight=torch.zeros(1), runtime_gather_output=True)
    assert bias is None and out.dtype == torch.float32
    torch.testing.assert_close(out, x @ head.weight.T)
    assert head.bias is None
    assert tu.LinearForLastLayer(8, 1, sequence_parallel=True).weight.sequence_parallel is True

    chunks = [nn.Module(), nn.Module()]
    for c in chunks:
        c.output_layer = nn.Linear(8, 100)
    out_chunks = tu.create_value_head_hook(hidden_size=8, sequence_parallel=False, output_size=3)(chunks)
    assert out_chunks == chunks
    assert isinstance(chunks[0].output_layer, nn.Linear) and not isinstance(chunks[0].output_layer, tu.LinearForLastLayer)
    assert isinstance(chunks[1].output_layer, tu.LinearForLastLayer) and chunks[1].output_layer.out_features == 3

    stage = nn.Module()
    stage.post_process = False
    last = nn.Module()
    last.post_process = True
    tu.make_value_model(8, False)([last, stage])  # post_process decides, not list position
    assert isinstance(last.output_layer, tu.LinearForLastLayer) and last.output_layer.out_features == 1
    assert not hasattr(stage, "output_layer")


def test_moe_metric_writer():
    calls = []

    class Rec:
        def __init__(self, kind):
            self.kind = kind

        def add_scalar(self, name, value, it):
            calls.append((self.kind, name, value, it))

        def log_metrics(self, metrics, step):
            calls.append((self.kind, metrics, step))

    tb = Rec("tb")
    assert tu._build_moe_metric_writer(tb, None, None) is tb
    assert tu._build_moe_metric_writer(None, None, None) is None
    w = tu._build_moe_metric_writer(None, Rec("comet"), Rec("mlflow"))
    assert isinstance(w, tu._MoeMetricFanoutWriter)
    w.add_scalar("moe/load_balancing_loss", torch.tensor(0.25), 3)
    assert calls == [("mlflow", {"moe/load_balancing_loss": 0.25}, 3), ("comet", {"moe/load_balancing_loss": 0.25}, 3)]
    calls.clear()
    tu._MoeMetricFanoutWriter(tb, None, None).add_scalar("x", 1.0, 4)
    assert calls == [("tb", "x", 1.0, 4)]
    assert tu._MoeMetricFanoutWriter._sanitize(torch.tensor(2)) == 2


# ---------------------------------------------------------------------------------------------- reports
def test_report_memory_cpu_and_with_fake_cuda_stats(monkeypatch):
    if not torch.cuda.is_available():
        assert tu.report_memory(None) == {}
    stats = {"allocated_bytes.all.current": 1_234_567_890, "num_alloc_retries": 2, "reserved_bytes.all.peak": 0}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda: stats)
    assert tu.report_memory(None) == {
        "mem-allocated-gigabytes": 1.2346, "mem-alloc-retires": 2, "mem-max-reserved-gigabytes": 0.0,
    }
    assert tu.report_memory({"num_alloc_retries": "retries"}) == {"retries": 2}


def test_start_memory_history_recording_without_cuda(monkeypatch, captured):
    tu.start_memory_history_recording(None)
    tu.start_memory_history_recording(NS(record_memory_history=False, profile_ranks=[0]))
    tu.start_memory_history_recording(NS(record_memory_history=True, profile_ranks=[3]))
    assert captured == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    tu.start_memory_history_recording(NS(record_memory_history=True, profile_ranks=[0]))
    assert len(captured) == 1 and "CUDA is not available" in captured[0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_start_memory_history_recording_cuda(tmp_path):
    prof = NS(record_memory_history=True, profile_ranks=[0], memory_snapshot_path=str(tmp_path / "snap.pickle"))
    tu.start_memory_history_recording(prof)
    x = torch.ones(1024, device="cuda")
    path = profiling.dump_memory_snapshot(prof)
    torch.cuda.memory._record_memory_history(enabled=None)
    import pickle

    snapshot = pickle.loads(open(path, "rb").read())
    assert any(trace for trace in snapshot["device_traces"])
    del x


def test_report_runtime(monkeypatch):
    ts = TrainState(step=25, consumed_train_samples=200)
    monkeypatch.setattr(time, "time", lambda: 1000.0)
    r = tu.report_runtime(ts, start_time=950, seq_length=16, train_iters=100)
    assert r == {"time/remaining_estimate": 150.0, "time/tokens": 3200, "time/samples": 200, "time/batches": 25,
                 "time/total": 50.0}
    r = tu.report_runtime(ts, 950, 16, 100, time_unit="minutes")
    assert r["time/remaining_estimate"] == pytest.approx(2.5) and r["time/total"] == pytest.approx(50 / 60)
    assert "time/remaining_estimate" not in tu.report_runtime(TrainState(), 950, 16, 100)
    with pytest.raises(ConfigError, match="fortnights"):
        tu.report_runtime(ts, 950, 16, 100, time_unit="fortnights")


def test_report_throughput():
    train_cfg = NS(global_batch_size=8, micro_batch_size=2)
    r = tu.report_throughput(train_cfg, 10, 32, [0.0, 1.0, 2.0, 3.0, 5.0], window_size=5)
    assert r["throughput/batches_per_sec"] == pytest.approx(4 / 5)
    assert r["throughput/samples_per_sec"] == pytest.approx(32 / 5)
    assert r["throughput/tokens_per_sec"] == pytest.approx(32 * 32 / 5)
    assert r["throughput/device/samples_per_sec"] == pytest.approx(32 / 5)
    assert r["throughput/global_batch_size"] == 8 and r["throughput/micro_batch_size"] == 2
    assert tu.report_throughput(train_cfg, 10, 32, [0.0, 1.0], window_size=5) == {}
    assert tu.report_throughput(train_cfg, 10, 32, [1.0, 1.0, 1.0], window_size=3) == {}


# ---------------------------------------------------------------------------------------------- progress log, profiling
def test_progress_log(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    append_to_progress_log(str(tmp_path), "Starting job")
    msg = format_saved_checkpoint_message(100, 12.345, 11.0, 1.5e15, 2.5e9)
    assert msg == ("Saved checkpoint\tIteration: 100\tJob throughput: 12.3 TFLOP/s/GPU\tCumulative throughput: "
                   "11.0 TFLOP/s/GPU\tFloating-point operations: 1.50e+15\tTokens (in billions): 2.50")
    append_to_progress_log(str(tmp_path), msg)
    lines = (tmp_path / "progress.txt").read_text().splitlines()
    pattern = r"^\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}\tJob ID: 4242\t# GPUs: 1\t"
    assert re.match(pattern + r"Starting job$", lines[0])
    assert re.match(pattern + re.escape(msg) + "$", lines[1])
    entries = parse_progress_log(str(tmp_path))
    assert [e.message for e in entries] == ["Starting job", "Saved checkpoint"]
    assert entries[1].fields["Iteration"] == "100" and entries[1].num_gpus == 1 and entries[1].job_id == "4242"
    append_to_progress_log(None, "ignored")
    assert parse_progress_log(str(tmp_path / "none")) == []


def test_profiling_helpers(tmp_path):
    cfg = NS(logger=NS(tensorboard_dir=str(tmp_path)), checkpoint=NS(save=None))
    prof_cfg = NS(profile_ranks=[0], profile_step_start=1, profile_step_end=2, record_shapes=False,
                  use_pytorch_profiler=True, use_nsys_profiler=False)
    assert profiling.should_profile_rank(prof_cfg, 0) and not profiling.should_profile_rank(prof_cfg, 1)
    assert not profiling.should_profile_rank(None, 0)
    assert profiling.profiler_trace_dir(cfg) == str(tmp_path)
    prof = profiling.build_pytorch_profiler(prof_cfg, NS(cfg=cfg))
    assert isinstance(prof, torch.profiler.profile)
    prof.start()
    torch.ones(4).sum()
    prof.stop()
    assert any(name.endswith(".pt.trace.json") for name in os.listdir(tmp_path))
    assert profiling.build_pytorch_profiler(NS(**{**vars(prof_cfg), "profile_ranks": [1]}), NS(cfg=cfg)) is None


def test_throughput_token_rates_count_real_tokens_when_the_run_counts_them():
    """Padded batches: the token rates of the TensorBoard throughput report are the window's real tokens per
    second, not samples × seq_length (the samples and batch rates stay Megatron Bridge's)."""
    from longspan.training.observability.log_line import real_token_rates

    train_cfg = NS(global_batch_size=8, micro_batch_size=2)
    wct = [0.0, 1.0, 2.0, 3.0, 5.0]
    padded = tu.report_throughput(train_cfg, 10, 32, wct, window_size=5)
    marks = [100, 173, 250, 331, 400]  # 300 real tokens in the window's 4 iterations (of 4 × 8 × 32 positions)
    rates = real_token_rates(padded, marks, wct, 5)
    assert rates["throughput/tokens_per_sec"] == pytest.approx(300 / 5)
    assert rates["throughput/device/tokens_per_sec"] == pytest.approx(300 / 5)
    assert rates["throughput/samples_per_sec"] == padded["throughput/samples_per_sec"] == pytest.approx(32 / 5)
    assert real_token_rates(padded, marks[-2:], wct, 5) == padded  # the window is not full of marks yet
    assert real_token_rates({}, marks, wct, 5) == {}
