"""Timers: Megatron's API and report strings (single process; the 2-rank cases run in test_train_utils)."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from longspan.core.errors import ConfigError
from longspan.training.observability.timers import DummyTimer, Timer, Timers


@pytest.fixture
def captured():
    """Records logged on the ``longspan`` logger (independent of handlers other tests installed)."""
    records: list[str] = []

    class _H(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    lg = logging.getLogger("longspan")
    handler = _H(level=logging.INFO)
    old_level = lg.level
    lg.addHandler(handler)
    lg.setLevel(logging.INFO)
    yield records
    lg.removeHandler(handler)
    lg.setLevel(old_level)


def test_timer_accumulates_and_resets():
    t = Timer("x")
    t.start()
    time.sleep(0.02)
    t.stop()
    t.start()
    time.sleep(0.02)
    t.stop()
    first = t.elapsed(reset=False)
    assert 0.04 <= first < 1.0
    assert t.elapsed(reset=True) == first
    assert t.elapsed() == 0.0
    # active time keeps counting across resets
    assert t.active_time() == pytest.approx(first)


def test_elapsed_on_running_timer_keeps_it_running():
    t = Timer("x")
    t.start()
    time.sleep(0.01)
    e1 = t.elapsed(reset=True)
    time.sleep(0.01)
    t.stop()
    assert e1 >= 0.01
    assert t.elapsed() >= 0.01


def test_double_start_and_stop_without_start_raise():
    t = Timer("x")
    with pytest.raises(RuntimeError):
        t.stop()
    t.start()
    with pytest.raises(RuntimeError):
        t.start()


def test_levels_above_config_are_shared_dummies():
    timers = Timers(log_level=0, log_option="minmax")
    d1 = timers("fine", log_level=1)
    d2 = timers("finer", log_level=2)
    d3 = timers("unspecified")  # no level means level 2, as in Megatron
    assert isinstance(d1, DummyTimer) and d1 is d2 is d3
    d1.start()
    d1.stop()
    with pytest.raises(RuntimeError):
        d1.elapsed()
    real = timers("interval-time", log_level=0)
    assert isinstance(real, Timer)
    assert timers("interval-time") is real
    assert timers.names() == ["interval-time"]


def test_level_mismatch_and_bad_options():
    timers = Timers(log_level=2, log_option="max")
    timers("a", log_level=1)
    with pytest.raises(RuntimeError):
        timers("a", log_level=0)
    with pytest.raises(ConfigError, match="logger.timing_log_option"):
        Timers(0, "median")
    with pytest.raises(ConfigError, match="logger.timing_log_level"):
        Timers(3, "max")


def test_no_cuda_synchronize_on_cpu(monkeypatch):
    def boom():
        raise AssertionError("CUDA synchronize called on a CPU run")

    monkeypatch.setattr(torch.cuda, "synchronize", boom)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        pytest.skip("CUDA in use in this process")
    t = Timer("x")
    t.start()
    t.stop()


def _timers_with(values: dict[str, float], option: str) -> Timers:
    timers = Timers(log_level=2, log_option=option)
    for name, seconds in values.items():
        timers(name, log_level=0).set_elapsed(seconds)
    return timers


def test_one_process_string_names_no_ranks():
    """Megatron's "(min, max) time across ranks" has nothing to compare in one process: one time per timer, under
    every log option (the two-rank strings: tests/training/test_train_utils.py::test_two_rank_dtensor_...)."""
    timers = _timers_with({"forward-backward": 0.5, "optimizer": 0.25}, "minmax")
    text = timers.get_all_timers_string(["forward-backward", "optimizer", "never-created"], normalizer=2.0)
    expected = (
        "time (ms):"
        + "\n    " + "forward-backward ".ljust(48, ".") + ": 250.00"
        + "\n    " + "optimizer ".ljust(48, ".") + ": 125.00"
    )
    assert text == expected
    # reset=True (default) zeroed them: nothing left to report
    assert timers.get_all_timers_string(["forward-backward", "optimizer"]) is None
    for option in ("max", "all"):
        timers = _timers_with({"fwd": 0.003}, option)
        assert timers.get_all_timers_string(["fwd"]) == "time (ms):\n    " + "fwd ".ljust(48, ".") + ": 3.00"


def test_log_returns_and_logs_on_last_rank(captured):
    timers = _timers_with({"save-checkpoint": 1.5}, "minmax")
    text = timers.log(["save-checkpoint"], normalizer=3.0)
    assert text is not None and text.endswith(": 500.00")
    assert captured == [text]
    captured.clear()
    timers = _timers_with({"save-checkpoint": 1.5}, "minmax")
    assert timers.log(["save-checkpoint"], rank=5) is not None
    assert captured == []  # rank 5 is not this process


def test_write_to_summary_writer_like_and_wandb_like():
    calls = []

    class TB:
        def add_scalar(self, tag, value, step):
            calls.append((tag, value, step))

    timers = _timers_with({"forward-backward": 0.6}, "minmax")
    out = timers.write(["forward-backward", "missing"], TB(), 7, normalizer=3.0)
    assert calls == [("forward-backward-time", pytest.approx(0.2), 7)]
    assert out == {"forward-backward-time": pytest.approx(0.2)}
    # reset defaults to False: the value is still there for the text log
    assert timers("forward-backward").elapsed(reset=False) == pytest.approx(0.6)

    logged = []

    class WB:
        def log(self, d, step):
            logged.append((d, step))

    timers.write(["forward-backward"], WB(), 8, reset=True)
    assert logged == [({"forward-backward-time": pytest.approx(0.6)}, 8)]
    assert timers("forward-backward").elapsed() == 0.0
