"""Metric sinks: JSON lines, fan-out to W&B / MLflow / Comet-shaped clients, MLflow name sanitizing."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace as NS

import pytest
import torch

from longspan.core.errors import ConfigError
from longspan.training import loggers
from longspan.training.loggers import (
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
