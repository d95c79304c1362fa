"""The experiment trackers through their real clients, offline: W&B offline mode, MLflow with a
local file store, Comet offline. Each gets every logged training iteration's ``lm loss``."""

from __future__ import annotations

import json
import time
import zipfile
from pathlib import Path

import pytest

from longspan.training.step.forward_step import forward_step
from longspan.training.pretrain import pretrain
from tests.training.pretrain_helpers import losses_by_iteration, small_config

ITERS = 4


def _run(tmp_path: Path, **logger_fields) -> dict[int, float]:
    cfg = small_config(tmp_path, "run", train_iters=ITERS, eval_interval=None)
    cfg.checkpoint.save = cfg.checkpoint.load = None
    for key, value in logger_fields.items():
        setattr(cfg.logger, key, value)
    pretrain(cfg, forward_step)
    return losses_by_iteration(cfg)


@pytest.mark.slow
def test_wandb_offline_run_holds_the_lm_loss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import wandb  # noqa: F401 - the client is a test dependency: a missing one fails loudly

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    losses = _run(tmp_path, wandb_project="longspan-test", wandb_exp_name="offline",
                  wandb_save_dir=str(tmp_path / "wandb"))
    runs = list((tmp_path / "wandb").rglob("offline-run-*"))
    assert len(runs) == 1, runs
    # W&B's service process writes the run's record log; allow it a moment after finish() on a busy machine.
    deadline = time.time() + 20
    while True:
        history = b"".join(p.read_bytes() for p in runs[0].glob("*.wandb"))
        if history.count(b"lm loss") >= ITERS or time.time() > deadline:
            break
        time.sleep(0.2)
    assert history.count(b"lm loss") >= ITERS  # one history record per logged iteration


@pytest.mark.slow
def test_mlflow_file_store_holds_every_iteration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import mlflow
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store behind this switch
    uri = (tmp_path / "mlruns").as_uri()
    losses = _run(tmp_path, mlflow_experiment="longspan-test", mlflow_run_name="file-store",
                  mlflow_tracking_uri=uri, mlflow_tags={"suite": "offline"})
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("longspan-test")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "file-store" and run.data.tags["suite"] == "offline"
    assert run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "lm loss")
    assert {m.step: m.value for m in history} == pytest.approx({i: losses[i] for i in range(1, ITERS + 1)})
    assert mlflow.active_run() is None  # the run was ended with the training


@pytest.mark.slow
def test_comet_offline_archive_holds_the_metrics(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import comet_ml  # noqa: F401

    offline = tmp_path / "comet"
    monkeypatch.setenv("COMET_START_ONLINE", "false")  # comet.start.online: the offline archive
    monkeypatch.setenv("COMET_OFFLINE_DIRECTORY", str(offline))
    monkeypatch.setenv("COMET_API_KEY", "offline-key")
    losses = _run(tmp_path, comet_project="longspan-test", comet_experiment_name="offline", comet_tags=["ci"])
    archives = list(offline.glob("*.zip"))
    assert len(archives) == 1, list(offline.iterdir()) if offline.exists() else "no offline directory"
    with zipfile.ZipFile(archives[0]) as archive:
        text = "\n".join(archive.read(n).decode("utf-8", "replace") for n in archive.namelist())
    logged = {}
    for line in text.splitlines():
        try:
            message = json.loads(line)
        except ValueError:
            continue
        payload = message.get("payload", message) if isinstance(message, dict) else {}
        metric = payload.get("metric") if isinstance(payload, dict) else None
        if isinstance(metric, dict) and metric.get("metricName") == "lm loss":
            logged[int(metric["step"])] = float(metric["metricValue"])
    assert logged == pytest.approx({i: losses[i] for i in range(1, ITERS + 1)})
