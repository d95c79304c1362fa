"""Metric sinks: JSON lines, fan-out to W&B / MLflow / Comet-shaped clients, MLflow name sanitizing, and what
training_log / log_validation_results write into TensorBoard (read back with TensorBoard's EventAccumulator)
and metrics.jsonl."""

from __future__ import annotations

import json
import math
import time
from types import SimpleNamespace as NS

import pytest
import torch
import torch.nn as nn

from longspan.config.schema.container import ConfigContainer
from longspan.config.schema.optim import OptimizerConfig
from longspan.config.schema.training import CheckpointConfig, LoggerConfig, TrainingConfig
from longspan.core.errors import ConfigError
from longspan.models.gpt_provider import GPTModelProvider
from longspan.training.observability import loggers
from longspan.training.state import GlobalState
from longspan.training.observability import log_line
from longspan.training.utils import train_utils as tu
from longspan.training.observability.loggers import (
    MetricsJSONLWriter,
    build_tensorboard_writer,
    build_wandb_logger,
    log_scalars,
    metrics_jsonl_path,
    sanitize_mlflow_metrics,
    to_python_scalar,
)


def test_jsonl_writer_is_lazy_strict_and_appends(tmp_path):
    path = tmp_path / "sub" / "metrics.jsonl"
    w = MetricsJSONLWriter(str(path))
    assert not path.exists()
    w.write({"iteration": 1, "loss": torch.tensor(2.5), "nan": float("nan"), "pair": torch.tensor([1.0, 2.0])})
    w.log({"iteration": 2, "inf": torch.tensor(float("inf")), "nested": {"a": torch.tensor(3)}})
    w.close()
    lines = path.read_text().splitlines()
    # strict JSON: json.loads with parse_constant rejecting NaN/Infinity
    records = [json.loads(line, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}")) for line in lines]
    assert records == [
        {"iteration": 1, "loss": 2.5, "nan": None, "pair": [1.0, 2.0]},
        {"iteration": 2, "inf": None, "nested": {"a": 3}},
    ]
    w.write({"iteration": 3})
    w.close()
    assert len(path.read_text().splitlines()) == 3


def test_to_python_scalar():
    assert to_python_scalar(torch.tensor(3)) == 3 and isinstance(to_python_scalar(torch.tensor(3)), int)
    assert to_python_scalar(1.5) == 1.5
    assert to_python_scalar(math.inf) is None
    assert to_python_scalar(True) is True
    assert to_python_scalar(None) is None


def test_metrics_jsonl_path_precedence():
    cfg = NS(logger=NS(tensorboard_dir="/tb"), checkpoint=NS(save="/ck"))
    assert metrics_jsonl_path(cfg) == "/tb/metrics.jsonl"
    cfg.logger.tensorboard_dir = None
    assert metrics_jsonl_path(cfg) == "/ck/metrics.jsonl"
    cfg.checkpoint.save = None
    assert metrics_jsonl_path(cfg) is None


def test_sanitize_mlflow_metrics():
    out = sanitize_mlflow_metrics({"lm loss": torch.tensor(1.0), "a@b": 2, "ok/x-y.z_1": 3.0, "bad": float("nan"), "s": "x"})
    assert out == {"lm loss": 1.0, "a_b": 2.0, "ok/x-y.z_1": 3.0}


class _Recorder:
    def __init__(self):
        self.calls = []

    def add_scalar(self, tag, value, step):
        self.calls.append(("tb", tag, value, step))

    def log(self, d, step):
        self.calls.append(("wandb", d, step))

    def log_metrics(self, d, step):
        self.calls.append(("metrics", d, step))


def test_log_scalars_fans_out():
    tb, wb, mlf, comet = _Recorder(), _Recorder(), _Recorder(), _Recorder()
    log_scalars({"lm loss": torch.tensor(2.0), "x y!": 1}, 5, tb, wb, mlf, comet)
    assert tb.calls == [("tb", "lm loss", torch.tensor(2.0), 5), ("tb", "x y!", 1, 5)]
    assert wb.calls == [("wandb", {"lm loss": 2.0, "x y!": 1}, 5)]
    assert mlf.calls == [("metrics", {"lm loss": 2.0, "x y_": 1.0}, 5)]
    assert comet.calls == [("metrics", {"lm loss": 2.0, "x y!": 1}, 5)]
    log_scalars({}, 6, tb)
    assert len(tb.calls) == 2


def test_build_tensorboard_writer(tmp_path):
    assert build_tensorboard_writer(NS(tensorboard_dir=None)) is None
    w = build_tensorboard_writer(NS(tensorboard_dir=str(tmp_path), tensorboard_queue_size=3))
    assert w.max_queue == 3
    w.close()


def test_wandb_with_fake_client(tmp_path, monkeypatch):
    inits = []
    fake = NS(init=lambda **kw: inits.append(kw))
    monkeypatch.setattr(loggers, "_import_optional", lambda cfg, field: fake)
    cfg = NS(
        logger=NS(wandb_project="p", wandb_exp_name="run", wandb_save_dir=None, wandb_entity="me"),
        checkpoint=NS(save=str(tmp_path)),
        train=NS(train_iters=3),
    )
    assert build_wandb_logger(cfg) is fake
    assert inits[0]["project"] == "p" and inits[0]["name"] == "run" and inits[0]["entity"] == "me"
    assert inits[0]["dir"] == str(tmp_path / "wandb")
    assert inits[0]["config"]["train"] == {"train_iters": 3}
    cfg.logger.wandb_exp_name = ""
    with pytest.raises(ConfigError, match="logger.wandb_exp_name"):
        build_wandb_logger(cfg)
    cfg.logger.wandb_project = None
    assert build_wandb_logger(cfg) is None


# ---------------------------------------------------------------------------------------------- training_log sinks
def make_cfg(tmp_path, **logger):
    base = dict(
        log_interval=2, log_throughput=True, timing_log_level=0, timing_log_option="minmax",
        tensorboard_dir=str(tmp_path / "tb"), tensorboard_log_interval=1, tensorboard_queue_size=10,
        log_timers_to_tensorboard=True, log_loss_scale_to_tensorboard=True, log_validation_ppl_to_tensorboard=True,
        log_memory_to_tensorboard=False, log_world_size_to_tensorboard=True, wandb_project=None,
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


# make_cfg's model at batch 8, matmul by matmul: per token and layer q/k/v/out projections
# (2*64*64 + 2*2*64*32 + 2*64*64), SwiGLU MLP (3 * 2*64*128), causal attention (2*2*64*32 / 2); logits 2*64*256;
# training = 3 x forward.
FLOPS_PER_ITER = 3 * 8 * 32 * (2 * (2 * 64 * 64 + 2 * 2 * 64 * 32 + 2 * 64 * 64 + 3 * 2 * 64 * 128 + 2 * 64 * 32)
                                + 2 * 64 * 256)


def read_scalars(tb_dir) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    ea.Reload()
    return {tag: [(e.step, e.value) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}


def step(state, cfg, total, loss_dict, *, grad_norm=1.25, params_norm=None, num_zeros=None, wct=None, model=()):
    """One iteration of the trainer's bookkeeping followed by training_log."""
    ts = state.train_state
    ts.step += 1
    ts.consumed_train_samples += cfg.train.global_batch_size
    wct.append(time.time())
    return tu.training_log(loss_dict, total, 2.5e-4, None, 4096.0, True, 0, grad_norm, params_norm,
                           num_zeros, cfg, state, wct, list(model))


def test_flops_constant_matches_formula(tmp_path):
    assert tu.num_floating_point_operations(make_cfg(tmp_path), 8) == FLOPS_PER_ITER


def test_throughput_from_running_flops_total_after_resume(tmp_path):
    cfg = make_cfg(tmp_path, log_interval=2)
    state = GlobalState(cfg)
    state.train_state.floating_point_operations_so_far = 1e15  # loaded from a checkpoint
    total, wct = {}, []
    for i in range(4):
        state.train_state.floating_point_operations_so_far += FLOPS_PER_ITER * (i + 1)  # what the trainer adds
        if i % 2 == 1:
            state.timers("interval-time", log_level=0).set_elapsed(0.5)
        step(state, cfg, total, {"lm loss": 1.0}, wct=wct)
    state.close_loggers()
    scalars = read_scalars(tmp_path / "tb")
    assert scalars["throughput"][0] == (2, pytest.approx((1 + 2) * FLOPS_PER_ITER / 0.5 / 1e12, rel=1e-5))
    assert scalars["throughput"][1] == (4, pytest.approx((3 + 4) * FLOPS_PER_ITER / 0.5 / 1e12, rel=1e-5))


def test_tensorboard_tags_and_jsonl(tmp_path):
    cfg = make_cfg(tmp_path, log_interval=2)
    state = GlobalState(cfg)
    total, wct = {}, []
    for i in range(4):
        step(state, cfg, total, {"lm loss": torch.tensor([2.0 * (i + 1), 2.0]), "aux": 0.5}, params_norm=3.0,
             num_zeros=0, wct=wct)
    state.close_loggers()
    scalars = read_scalars(tmp_path / "tb")
    for tag in ("lm loss", "aux", "learning-rate", "batch-size", "loss-scale", "grad-norm", "params-norm",
                "num-zeros", "iteration-time", "world-size", "throughput", "lm loss vs samples"):
        assert tag in scalars, (tag, sorted(scalars))
    assert scalars["lm loss"] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0)]
    assert scalars["lm loss vs samples"] == [(8, 1.0), (16, 2.0), (24, 3.0), (32, 4.0)]
    assert [s for s, _ in scalars["iteration-time"]] == [2, 4]
    assert scalars["batch-size"][0] == (1, 8.0) and scalars["world-size"][0] == (1, 1.0)
    assert scalars["loss-scale"][0] == (1, 4096.0)
    assert scalars["learning-rate"][0][1] == pytest.approx(2.5e-4)

    records = [json.loads(line) for line in (tmp_path / "tb" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2, 3, 4]
    r = records[2]
    assert r["phase"] == "train" and r["consumed_samples"] == 24 and r["losses"] == {"lm loss": 3.0, "aux": 0.5}
    assert r["grad_norm"] == 1.25 and r["loss_scale"] == 4096.0 and r["lr"] == pytest.approx(2.5e-4)
    assert r["skipped_iterations"] == 0 and r["nan_iterations"] == 0 and r["params_norm"] == 3.0
    dt = wct[2] - wct[1]
    assert r["iteration_time_s"] == pytest.approx(dt)
    assert r["tokens_per_s"] == pytest.approx(8 * 32 / dt)
    assert r["throughput"] == pytest.approx(FLOPS_PER_ITER / dt / 1e12)
    assert records[0]["iteration_time_s"] is None


def test_tensorboard_interval_and_switches(tmp_path, monkeypatch):
    cfg = make_cfg(tmp_path, tensorboard_log_interval=2, log_loss_scale_to_tensorboard=False,
                   log_timers_to_tensorboard=False, log_world_size_to_tensorboard=False, log_throughput=False,
                   log_memory_to_tensorboard=True)
    monkeypatch.setattr(log_line, "report_memory", lambda keys: {"mem-allocated-gigabytes": 1.5, "mem-allocated-count": 3})
    state = GlobalState(cfg)
    total, wct = {}, []
    for _ in range(4):
        step(state, cfg, total, {"lm loss": 1.0}, wct=wct)
    state.close_loggers()
    scalars = read_scalars(tmp_path / "tb")
    assert [s for s, _ in scalars["lm loss"]] == [2, 4]
    assert scalars["mem-allocated-gigabytes"] == [(2, 1.5), (4, 1.5)]
    assert "mem-allocated-count" in scalars
    for absent in ("loss-scale", "iteration-time", "world-size", "throughput"):
        assert absent not in scalars


def test_optional_report_tags(tmp_path):
    cfg = make_cfg(tmp_path, log_l2_norm_grad_to_tensorboard=True, log_runtime_to_tensorboard=True,
                   log_throughput_to_tensorboard=True, throughput_window_size=2, runtime_time_unit="seconds")
    lin = nn.Linear(2, 2, bias=False)
    lin.weight.grad = torch.full((2, 2), 0.5)
    state = GlobalState(cfg)
    total, wct = {}, []
    for _ in range(2):
        step(state, cfg, total, {"lm loss": 1.0}, wct=wct, model=[lin])
    state.close_loggers()
    scalars = read_scalars(tmp_path / "tb")
    assert scalars["l2_norm/grad/global"][0] == (1, pytest.approx(1.0))
    assert scalars["l2_norm/grad/weight"][0] == (1, pytest.approx(1.0))
    assert scalars["time/samples"] == [(1, 8.0), (2, 16.0)]
    assert [s for s, _ in scalars["throughput/samples_per_sec"]] == [2]  # window of 2 full at iteration 2
    assert scalars["throughput/samples_per_sec"][0][1] == pytest.approx(8 / (wct[1] - wct[0]), rel=1e-5)


def test_validation_block(tmp_path, captured):
    cfg = make_cfg(tmp_path)
    state = GlobalState(cfg)
    state.train_state.consumed_train_samples = 40
    line = tu.log_validation_results("iteration 5", {"lm loss": torch.tensor([4.0, 2.0])}, 5, state)
    expected = f" validation loss at iteration 5 | lm loss value: 2.000000E+00 | lm loss PPL: {math.exp(2.0):.6E} | "
    assert line == expected
    assert captured[-3:] == ["-" * (len(expected) + 1), expected, "-" * (len(expected) + 1)]
    cfg.logger.log_validation_ppl_to_tensorboard = False
    tu.log_validation_results("iteration 6", {"lm loss": 30.0}, 6, state)  # PPL capped at exp(20)
    assert f"lm loss PPL: {math.exp(20):.6E}" in captured[-2]
    state.close_loggers()
    scalars = read_scalars(tmp_path / "tb")
    assert scalars["lm loss validation"] == [(5, 2.0), (6, 30.0)]
    assert scalars["lm loss validation ppl"] == [(5, pytest.approx(math.exp(2.0)))]
    assert scalars["lm loss validation vs samples"][0] == (40, 2.0)
    last = json.loads((tmp_path / "tb" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["phase"] == "validation" and last["losses"] == {"lm loss": 30.0} and last["iteration"] == 6
