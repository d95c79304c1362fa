"""Seed-001 functions and the loop's exit / gc / eval-only / precision behaviours."""

from __future__ import annotations

import gc
import time
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from longspan.core.errors import ConfigError
from longspan.training import train as train_module
from longspan.training.step.forward_step import forward_step
from longspan.training.step.microbatches import NumMicroBatchesCalculator
from longspan.training.pretrain import pretrain
from longspan.training.train import (
    _handle_mxfp8_param_buffer_copy,
    disable_forward_pre_hook,
    enable_forward_pre_hook,
    get_start_time_from_progress_log,
    reduce_loss_reports,
    should_disable_forward_pre_hook,
)
from longspan.training.observability.progress_log import format_progress_line
from tests.training.pretrain_helpers import read_metrics, small_config


def _no_checkpoints(cfg):
    cfg.checkpoint.save = None
    cfg.checkpoint.load = None
    return cfg


def test_should_disable_forward_pre_hook_truth_table() -> None:
    for fsdp in (False, True):
        for dist_opt in (False, True):
            for overlap in (False, True):
                expected = (not fsdp) and dist_opt and overlap
                assert should_disable_forward_pre_hook(fsdp, dist_opt, overlap) is expected


def test_forward_pre_hook_toggles_reach_wrappers_that_have_them() -> None:
    calls = []
    wrapper = SimpleNamespace(
        enable_forward_pre_hook=lambda: calls.append("enable"),
        disable_forward_pre_hook=lambda param_sync=True: calls.append(("disable", param_sync)),
    )
    plain = torch.nn.Linear(2, 2)  # torch DDP/FSDP2 modules have no such hooks: nothing happens
    disable_forward_pre_hook([wrapper, plain], param_sync=False)
    enable_forward_pre_hook([wrapper, plain])
    assert calls == [("disable", False), "enable"]


def test_mxfp8_copy_only_when_both_flags_are_set() -> None:
    calls = []
    optimizer = SimpleNamespace(_copy_main_params_to_param_buffer=lambda: calls.append(1))
    _handle_mxfp8_param_buffer_copy(optimizer, True, False)
    _handle_mxfp8_param_buffer_copy(optimizer, False, True)
    assert calls == []
    _handle_mxfp8_param_buffer_copy(optimizer, True, True)
    assert calls == [1]


def test_reduce_loss_reports_is_sum_over_sum_and_mean_for_legacy_values() -> None:
    reports = [{"lm loss": torch.tensor([6.0, 3.0])}, {"lm loss": torch.tensor([2.0, 1.0])}]
    assert float(reduce_loss_reports(reports)["lm loss"]) == pytest.approx(8.0 / 4.0)
    legacy = [{"aux": torch.tensor(1.0)}, {"aux": torch.tensor(3.0)}]
    assert float(reduce_loss_reports(legacy)["aux"]) == pytest.approx(2.0)


def test_start_time_from_progress_log_restarts_on_world_size_change(tmp_path: Path) -> None:
    t0, t1 = datetime(2026, 1, 1, 10, 0, 0), datetime(2026, 1, 1, 12, 0, 0)
    lines = [
        format_progress_line("Starting job", 8, "1", now=t0),
        format_progress_line("Saved checkpoint\tIteration: 10\tJob throughput: 1.0 TFLOP/s/GPU\t"
                             "Cumulative throughput: 1.0 TFLOP/s/GPU\tFloating-point operations: 5.00e+15\t"
                             "Tokens (in billions): 0.01", 8, "1", now=t0),
        format_progress_line("Starting job", 8, "2", now=t1),  # same world size: keeps the first start
        format_progress_line("Starting job", 16, "3", now=t1),  # new world size: restarts the window
    ]
    (tmp_path / "progress.txt").write_text("".join(lines))
    cfg = SimpleNamespace(checkpoint=SimpleNamespace(save=str(tmp_path)))
    start, flops = get_start_time_from_progress_log(cfg)
    assert start == t1 and flops == pytest.approx(5e15)


def test_microbatch_calculator_decreases_batch_when_asked() -> None:
    calc = NumMicroBatchesCalculator(10, 2, 4, decrease_batch_size_if_needed=True)
    assert calc.get_current_global_batch_size() == 8 and calc.get() == 1
    with pytest.raises(ConfigError, match="decrease_batch_size_if_needed"):
        NumMicroBatchesCalculator(10, 2, 4)


def test_exit_duration_saves_and_stops(tmp_path: Path) -> None:
    def aging_forward_step(state, data_iterator, model):
        if state.train_state.step == 3:
            state.start_time = time.time() - 120  # the job has "run" two minutes
        return forward_step(state, data_iterator, model)

    cfg = small_config(tmp_path, "duration", exit_duration_in_mins=1)
    state = pretrain(cfg, aging_forward_step)
    assert state.train_state.step == 4
    assert (Path(cfg.checkpoint.save) / "latest_checkpointed_iteration.txt").read_text() == "4"


def test_manual_gc_disables_automatic_collection_and_collects_on_interval(tmp_path: Path, monkeypatch) -> None:
    collected = []
    real_collect = gc.collect
    monkeypatch.setattr(train_module.gc, "collect", lambda *a: collected.append(gc.isenabled()) or real_collect())
    seen_enabled = []

    def watching_forward_step(state, data_iterator, model):
        if model.training:  # the test-split evaluation after training runs with gc restored
            seen_enabled.append(gc.isenabled())
        return forward_step(state, data_iterator, model)

    cfg = _no_checkpoints(small_config(tmp_path, "gc", train_iters=6, manual_gc=True, manual_gc_interval=2,
                                       eval_interval=None))
    pretrain(cfg, watching_forward_step)
    assert seen_enabled and not any(seen_enabled)  # automatic gc is off while training
    assert gc.isenabled()  # and restored afterwards
    assert len(collected) == 1 + 3  # once at the start, then at iterations 2, 4, 6


def test_skip_train_only_evaluates(tmp_path: Path) -> None:
    cfg = _no_checkpoints(small_config(tmp_path, "skip", skip_train=True))
    state = pretrain(cfg, forward_step)
    assert state.train_state.step == 0
    assert state.train_state.consumed_valid_samples == cfg.train.eval_iters * cfg.train.global_batch_size
    assert read_metrics(cfg) == []


def test_fp16_mixed_uses_dynamic_loss_scaling(tmp_path: Path) -> None:
    cfg = _no_checkpoints(small_config(tmp_path, "fp16", train_iters=4, eval_interval=None))
    cfg.mixed_precision = "fp16_mixed"
    cfg.optimizer.initial_loss_scale = 2.0**40  # overflows in fp16: the first steps are skipped
    pretrain(cfg, forward_step)
    records = read_metrics(cfg)
    scales = [r["loss_scale"] for r in records]
    assert scales[0] < 2.0**40 and scales == sorted(scales, reverse=True)
    assert records[0]["skipped_iterations"] == 1


def test_pytorch_profiler_writes_a_trace_for_the_configured_steps(tmp_path: Path) -> None:
    from longspan.training.config import ProfilingConfig

    cfg = _no_checkpoints(small_config(tmp_path, "prof", train_iters=5, eval_interval=None))
    cfg.profiling = ProfilingConfig(use_pytorch_profiler=True, profile_step_start=2, profile_step_end=4, profile_ranks=[0])
    pretrain(cfg, forward_step)
    traces = list(Path(cfg.logger.tensorboard_dir).rglob("*.pt.trace.json*"))
    assert len(traces) == 1
