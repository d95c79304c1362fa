"""A run's logs are its own: a template's TensorBoard directory follows the run's checkpoint.save (a value the
user set never moves), and every sink carries the run's name and this launch's id; metrics.jsonl appends on
resume with the global iteration."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from longspan.recipes import get_recipe
from longspan.recipes.loading import load_config
from longspan.training.observability import loggers
from longspan.training.pretrain import pretrain
from longspan.training.step.forward_step import forward_step
from tests.training.pretrain_helpers import small_config

RUN_OF_ITS_OWN = ["checkpoint.save=runs/tiny-lr1e-3/checkpoints", "checkpoint.load=runs/tiny-lr1e-3/checkpoints"]


def _validated(cfg):
    cfg.validate(world_size=1)
    return cfg.logger.tensorboard_dir


def test_a_run_of_its_own_logs_beside_its_checkpoints(tmp_path: Path, captured) -> None:
    assert _validated(load_config("tiny", (), RUN_OF_ITS_OWN)) == "runs/tiny-lr1e-3/tensorboard"
    assert captured.count("> logger.tensorboard_dir=runs/tiny-lr1e-3/tensorboard: this run's logs follow its "
                          "checkpoint.save (runs/tiny/tensorboard is another run's); set logger.tensorboard_dir to "
                          "choose") == 1
    cfg = get_recipe("tiny")  # the README's Python run: the directories set in code
    cfg.checkpoint.save = cfg.checkpoint.load = "runs/tiny-50/checkpoints"
    assert _validated(cfg) == "runs/tiny-50/tensorboard"
    shown = tmp_path / "tiny.yaml"  # `config show` output, then a run of its own
    get_recipe("tiny").to_yaml(str(shown))
    assert _validated(load_config(None, [str(shown)], RUN_OF_ITS_OWN)) == "runs/tiny-lr1e-3/tensorboard"
    assert _validated(load_config("tiny", (), [])) == "runs/tiny/tensorboard"  # the recipe's own run


def test_a_log_directory_the_user_chose_never_moves(tmp_path: Path) -> None:
    chosen = load_config("tiny", (), [*RUN_OF_ITS_OWN, "logger.tensorboard_dir=runs/tiny/tensorboard"])
    assert _validated(chosen) == "runs/tiny/tensorboard"
    partial = tmp_path / "logs.yaml"
    partial.write_text("logger:\n  tensorboard_dir: /tmp/shared-tb\n")
    assert _validated(load_config("tiny", [str(partial)], RUN_OF_ITS_OWN)) == "/tmp/shared-tb"
    cfg = get_recipe("tiny")
    cfg.checkpoint.save = "runs/x/checkpoints"
    cfg.logger.tensorboard_dir = "elsewhere/tb"
    assert _validated(cfg) == "elsewhere/tb"


def test_metrics_jsonl_appends_on_resume_with_the_run_and_each_launchs_id(tmp_path: Path) -> None:
    cfg = small_config(tmp_path, "myrun", train_iters=2, eval_interval=None)
    pretrain(cfg, forward_step)
    cfg = small_config(tmp_path, "myrun", train_iters=4, eval_interval=None)
    cfg.scheduler.lr_warmup_iters = 1  # as the first launch's: only the length changes
    pretrain(cfg, forward_step)
    tb_dir = Path(cfg.logger.tensorboard_dir)
    records = [json.loads(line) for line in (tb_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("phase") == "train"]
    assert [r["iteration"] for r in train] == [1, 2, 3, 4]
    assert {r["run"] for r in records} == {"myrun"}
    first, second = train[0]["run_id"], train[2]["run_id"]
    assert first != second and first.startswith("myrun-") and [r["run_id"] for r in train] == [first] * 2 + [second] * 2
    events = b"".join(p.read_bytes() for p in tb_dir.glob("events.out.tfevents.*"))
    assert first.encode() in events and second.encode() in events  # TensorBoard's text "run" of each launch


def test_experiment_trackers_carry_the_run_name_and_id(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: dict[str, object] = {}
    fake_wandb = SimpleNamespace(init=lambda **kw: calls.update(wandb=kw))
    fake_mlflow = SimpleNamespace(set_experiment=lambda name: None, set_tracking_uri=lambda uri: None,
                                  start_run=lambda **kw: calls.update(mlflow=kw),
                                  exceptions=SimpleNamespace(MlflowException=RuntimeError))
    experiment = SimpleNamespace(set_name=lambda n: calls.update(comet_name=n), add_tags=lambda t: None,
                                 log_others=lambda d: calls.update(comet=d))
    fake_comet = SimpleNamespace(start=lambda **kw: experiment)
    modules = {"wandb_project": fake_wandb, "mlflow_experiment": fake_mlflow, "comet_project": fake_comet}
    monkeypatch.setattr(loggers, "_import_optional", lambda cfg, field: modules[field])
    cfg = get_recipe("tiny")
    cfg.checkpoint.save = "/tmp/longspan-test-unused/runs/exp7/checkpoints"
    cfg.logger.wandb_project, cfg.logger.wandb_save_dir = "p", "/tmp/longspan-test-unused/wandb"
    cfg.logger.mlflow_experiment, cfg.logger.mlflow_run_name = "e", "my-mlflow-name"
    cfg.logger.mlflow_tags = {"team": "x"}
    cfg.logger.comet_project, cfg.logger.comet_experiment_name = "c", "my-comet-name"
    run = loggers.run_identity(cfg, 0.0)
    assert run.name == "exp7" and run.run_id.startswith("exp7-")
    loggers.build_wandb_logger(cfg, run)
    loggers.build_mlflow_logger(cfg, run)
    loggers.build_comet_logger(cfg, run)
    assert calls["wandb"]["name"] == "exp7" and calls["wandb"]["config"]["run_id"] == run.run_id
    assert calls["mlflow"] == {"run_name": "my-mlflow-name",
                               "tags": {"longspan_run": "exp7", "longspan_run_id": run.run_id, "team": "x"}}
    assert calls["comet_name"] == "my-comet-name"
    assert calls["comet"] == {"longspan_run": "exp7", "longspan_run_id": run.run_id}
    cfg.logger.wandb_exp_name = "mine"  # a name the user gave is kept
    loggers.build_wandb_logger(cfg, run)
    assert calls["wandb"]["name"] == "mine"
