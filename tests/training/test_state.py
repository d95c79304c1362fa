"""TrainState (Stateful round trips) and GlobalState (lazy timers and sinks, optional integrations)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch.distributed.checkpoint.stateful import Stateful

from longspan.config.schema.container import ConfigContainer
from longspan.config.schema.training import CheckpointConfig, LoggerConfig, TrainingConfig
from longspan.core.errors import ConfigError
from longspan.training.observability.loggers import MetricsJSONLWriter
from longspan.training.state import GlobalState, TrainState
from longspan.training.observability.timers import Timer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cfg(tmp_path, tb=True, save=True, **logger):
    base = dict(
        timing_log_level=1,
        timing_log_option="max",
        tensorboard_dir=str(tmp_path / "tb") if tb else None,
        tensorboard_queue_size=5,
        wandb_project=None,
        wandb_exp_name=None,
        wandb_save_dir=None,
        wandb_entity=None,
    )
    base.update(logger)
    return ConfigContainer(logger=LoggerConfig(**base),
                           checkpoint=CheckpointConfig(save=str(tmp_path / "ckpt") if save else None),
                           train=TrainingConfig())


def _filled() -> TrainState:
    return TrainState(
        step=17,
        consumed_train_samples=3_000_000_000,  # past int32
        skipped_train_samples=4,
        consumed_valid_samples=64,
        floating_point_operations_so_far=1.25e18,
        do_train=True,
        do_valid=False,
        do_test=True,
    )


def test_train_state_defaults_and_protocol():
    ts = TrainState()
    assert (ts.step, ts.consumed_train_samples, ts.skipped_train_samples, ts.consumed_valid_samples) == (0, 0, 0, 0)
    assert ts.floating_point_operations_so_far == 0.0
    assert (ts.do_train, ts.do_valid, ts.do_test) == (False, False, False)
    assert isinstance(ts, Stateful)


def test_train_state_round_trip_through_torch_save(tmp_path):
    sd = _filled().state_dict()
    assert set(sd) == {
        "step", "consumed_train_samples", "skipped_train_samples", "consumed_valid_samples",
        "floating_point_operations_so_far", "do_train", "do_valid", "do_test",
    }
    assert sd["consumed_train_samples"].dtype == torch.int64
    assert sd["floating_point_operations_so_far"].dtype == torch.float64
    assert sd["do_train"].dtype == torch.bool
    torch.save(sd, tmp_path / "train_state.pt")
    restored = TrainState()
    restored.load_state_dict(torch.load(tmp_path / "train_state.pt", weights_only=True))
    assert restored == _filled()
    assert type(restored.step) is int and type(restored.do_train) is bool
    assert type(restored.floating_point_operations_so_far) is float


def test_train_state_loads_python_values():
    ts = TrainState()
    ts.load_state_dict({"step": 3, "consumed_train_samples": 12, "do_valid": 1, "floating_point_operations_so_far": 5})
    assert ts == TrainState(step=3, consumed_train_samples=12, do_valid=True, floating_point_operations_so_far=5.0)


def test_train_state_round_trip_through_dcp(tmp_path):
    import torch.distributed.checkpoint as dcp

    dcp.save({"train_state": _filled()}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    restored = TrainState()
    dcp.load({"train_state": restored}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    assert restored == _filled()


def test_construction_is_cheap_and_sinks_are_lazy(tmp_path):
    state = GlobalState(_cfg(tmp_path))
    assert not (tmp_path / "tb").exists()
    assert state.tokenizer is None and state.signal_handler is None and state.rerun_state_machine is None
    assert isinstance(state.train_state, TrainState) and state.train_state is state.train_state
    new = TrainState(step=5)
    state.train_state = new
    assert state.train_state is new

    timers = state.timers
    assert timers is state.timers
    assert (timers.log_level, timers.log_option) == (1, "max")
    assert isinstance(timers("optimizer", log_level=1), Timer)

    writer = state.tensorboard_logger
    assert writer is not None and writer is state.tensorboard_logger
    assert writer.max_queue == 5
    assert (tmp_path / "tb").is_dir()
    assert state.wandb_logger is None and state.mlflow_logger is None and state.comet_logger is None
    state.close_loggers()


def test_tensorboard_disabled_without_dir_or_off_last_rank(tmp_path, monkeypatch):
    assert GlobalState(_cfg(tmp_path, tb=False)).tensorboard_logger is None
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    state = GlobalState(_cfg(tmp_path))
    assert state.tensorboard_logger is None
    assert state.metrics_logger is None
    assert not (tmp_path / "tb").exists()
    monkeypatch.setenv("RANK", "1")
    state = GlobalState(_cfg(tmp_path))
    assert state.tensorboard_logger is not None
    state.close_loggers()


def test_metrics_logger_location(tmp_path):
    state = GlobalState(_cfg(tmp_path))
    assert isinstance(state.metrics_logger, MetricsJSONLWriter)
    assert state.metrics_logger.path == str(tmp_path / "tb" / "metrics.jsonl")
    state = GlobalState(_cfg(tmp_path, tb=False))
    assert state.metrics_logger.path == str(tmp_path / "ckpt" / "metrics.jsonl")
    assert GlobalState(_cfg(tmp_path, tb=False, save=False)).metrics_logger is None


def test_close_loggers_flushes_and_recreates(tmp_path):
    state = GlobalState(_cfg(tmp_path))
    run = {"run": state.run.name, "run_id": state.run.run_id}
    state.metrics_logger.write({"iteration": 1})
    state.close_loggers()
    path = tmp_path / "tb" / "metrics.jsonl"
    assert [json.loads(line) for line in path.read_text().splitlines()] == [{**run, "iteration": 1}]
    state.metrics_logger.write({"iteration": 2})
    state.close_loggers()
    # The recreated writer appends, with the same launch's name and id.
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        {**run, "iteration": 1}, {**run, "iteration": 2}]


@pytest.mark.parametrize(
    "field,value,attr,module,extra",
    [
        ("wandb_project", "proj", "wandb_logger", "wandb", "wandb"),
        ("mlflow_experiment", "exp", "mlflow_logger", "mlflow", "mlflow"),
        ("comet_project", "proj", "comet_logger", "comet_ml", "comet"),
    ],
)
def test_missing_optional_integration_is_one_line_config_error(tmp_path, monkeypatch, field, value, attr, module, extra):
    monkeypatch.setitem(sys.modules, module, None)  # makes the import fail even where it is installed
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == module else real_find_spec(name, *a))
    state = GlobalState(_cfg(tmp_path, **{field: value, "wandb_exp_name": "run"}))
    expected = f"logger.{field} is set but {module} is not installed: pip install longspan[{extra}]"
    with pytest.raises(ConfigError) as err:
        getattr(state, attr)
    assert str(err.value) == expected and "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=r"pip install longspan\[" + extra + r"\]"):
        state.check_logger_dependencies()


def test_sinks_wait_for_a_config(tmp_path):
    state = GlobalState()
    assert state.tensorboard_logger is None and state.metrics_logger is None
    state.cfg = _cfg(tmp_path)
    assert state.tensorboard_logger is not None and state.metrics_logger is not None
    state.close_loggers()


def test_reset_for_restart(tmp_path):
    state = GlobalState(_cfg(tmp_path))
    state.train_state.step = 9
    timers = state.timers
    state.reset_for_restart()
    assert state.train_state.step == 0
    assert state.timers is not timers


def test_state_module_imports_no_trainer_model_or_data_code():
    code = (
        "import sys, longspan.training.state, longspan.training.utils.train_utils;"
        "print(sorted(m for m in sys.modules if m.startswith('longspan.')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env={**os.environ, "PYTHONPATH": REPO},
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout
    for forbidden in ("longspan.training.train'", "longspan.models", "longspan.data", "longspan.parallel",
                      "longspan.training.checkpointing.save", "longspan.training.setup"):
        assert forbidden not in out, out
