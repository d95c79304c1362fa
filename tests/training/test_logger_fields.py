"""logger.memory_keys and logger.runtime_time_unit: the names and units the reports are written with."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from longspan.core.errors import ConfigError
from longspan.training.observability import memory
from longspan.training.observability.reports import report_runtime
from longspan.training.state import GlobalState, TrainState
from tests.training.test_loggers import make_cfg, read_scalars, step


def test_memory_keys_name_the_logged_allocator_statistics(tmp_path, monkeypatch) -> None:
    stats = {"allocated_bytes.all.current": 2.5e9, "num_alloc_retries": 3, "reserved_bytes.all.peak": 4e9}
    # the memory module's view of torch only: the rest of the process stays on the CPU
    fake_cuda = NS(is_available=lambda: True, is_initialized=lambda: True, memory_stats=lambda: stats)
    monkeypatch.setattr(memory, "torch", NS(cuda=fake_cuda))
    keys = {"allocated_bytes.all.current": "my-alloc-bytes", "num_alloc_retries": "my-retries"}
    cfg = make_cfg(tmp_path, log_memory_to_tensorboard=True, memory_keys=keys)
    state = GlobalState(cfg)
    total, wct = {}, []
    step(state, cfg, total, {"lm loss": 1.0}, wct=wct)
    state.close_loggers()
    scalars = read_scalars(tmp_path / "tb")
    assert scalars["my-alloc-gigabytes"] == [(1, 2.5)] and scalars["my-retries"] == [(1, 3.0)]
    assert "mem-max-reserved-gigabytes" not in scalars  # only the named statistics
    assert memory.report_memory(None)["mem-max-reserved-gigabytes"] == 4.0  # default: Megatron's names


def test_runtime_time_unit_scales_the_runtime_report(monkeypatch) -> None:
    ts = TrainState()
    ts.step, ts.consumed_train_samples = 2, 16
    monkeypatch.setattr("longspan.training.observability.reports.time.time", lambda: 1000.0 + 7200.0)
    seconds = report_runtime(ts, 1000, 8, 4, "seconds")
    hours = report_runtime(ts, 1000, 8, 4, "hours")
    assert seconds["time/total"] == 7200.0 and hours["time/total"] == 2.0
    assert hours["time/remaining_estimate"] == 2.0 and hours["time/tokens"] == 128


def test_logger_field_values_are_checked() -> None:
    from longspan.recipes.loading import load_config

    for override, fragment in (("logger.runtime_time_unit=weeks", "logger.runtime_time_unit='weeks' is not valid"),
                               ("logger.memory_keys={a: 1}", "logger.memory_keys={'a': 1} must map")):
        with pytest.raises(ConfigError, match=fragment):
            load_config("tiny", [], [override]).validate(world_size=1)
