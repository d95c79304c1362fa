"""Rerun state machine: each injected error type gives its verdict and exit code; a transient-error run resumes
with the losses of an uninjected run; report_stats sees zero variability on CPU and nonzero when the
computation is made nondeterministic."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from longspan.core.errors import ConfigError
from longspan.training.step.forward_step import forward_step
from longspan.training.pretrain import pretrain
from longspan.training.resilience.rerun import (
    CORRECT_RESULT,
    PERSISTENT_FAULT,
    REPRODUCIBLE_NEEDS_OTHER_HARDWARE,
    SAME_HARDWARE,
    TRANSIENT_FAULT,
)
from tests.resilience.helpers import resilience_config, run, write_yaml
from tests.training.pretrain_helpers import losses_by_iteration

ITERS = 6


def _events(cfg: Any) -> list[dict[str, Any]]:
    path = Path(cfg.logger.tensorboard_dir) / "metrics.jsonl"
    return [r for r in map(json.loads, path.read_text().splitlines()) if r.get("phase") == "resilience"]


def _verdicts(cfg: Any) -> list[str]:
    return [e["verdict"] for e in _events(cfg) if "verdict" in e]


def _progress_lines(cfg: Any) -> list[str]:
    return [ln for ln in (Path(cfg.checkpoint.save) / "progress.txt").read_text().splitlines() if "Resilience" in ln]


@pytest.fixture(scope="module")
def reference_losses(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    cfg = resilience_config(tmp_path_factory.mktemp("ref"), "ref", ITERS)
    pretrain(cfg)
    return losses_by_iteration(cfg)


def _injected(tmp_path: Path, kind: str) -> Any:
    cfg = resilience_config(tmp_path, kind, ITERS)
    cfg.rerun_state_machine.rerun_mode = "validate_results"
    cfg.rerun_state_machine.error_injection_rate = 1  # the first validated iteration (2)
    cfg.rerun_state_machine.error_injection_type = kind
    return cfg


def _tracker(cfg: Any) -> str:
    return (Path(cfg.checkpoint.save) / "latest_checkpointed_iteration.txt").read_text().strip()


@pytest.mark.slow
def test_transient_error_exits_17_and_resumes_with_the_uninjected_losses(tmp_path: Path, reference_losses) -> None:
    cfg = _injected(tmp_path, "transient_error")
    state = pretrain(cfg)
    assert state.exit_code == 17 and state.train_state.step == 1
    assert _tracker(cfg) == "1"  # saved before the rejected iteration's update
    assert _verdicts(cfg) == [TRANSIENT_FAULT]
    assert any("transient fault" in ln for ln in _progress_lines(cfg))

    cfg.rerun_state_machine.error_injection_rate = 0
    state = pretrain(cfg)
    assert getattr(state, "exit_code", None) is None and state.train_state.step == ITERS
    assert losses_by_iteration(cfg) == reference_losses  # bit-exact, dropout on


@pytest.mark.slow
@pytest.mark.parametrize("kind, verdict", [("persistent_error", PERSISTENT_FAULT), ("correct_result", CORRECT_RESULT)])
def test_reproducible_error_exits_16_then_decides_on_other_hardware(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, verdict: str
) -> None:
    cfg = _injected(tmp_path, kind)
    state = pretrain(cfg)
    assert state.exit_code == 16 and _tracker(cfg) == "1"
    assert _verdicts(cfg) == [REPRODUCIBLE_NEEDS_OTHER_HARDWARE]

    state = pretrain(cfg)  # same node, device and rank: not other hardware
    assert state.exit_code == 16
    assert _verdicts(cfg)[-1] == SAME_HARDWARE

    monkeypatch.setenv("LONGSPAN_NODE_NAME", "another-node")
    state = pretrain(cfg)
    assert state.exit_code == 17 and state.train_state.step == 1
    assert _verdicts(cfg)[-1] == verdict


def test_report_stats_zero_variability_on_cpu(tmp_path: Path, reference_losses) -> None:
    cfg = resilience_config(tmp_path, "stats", ITERS)
    cfg.rerun_state_machine.rerun_mode = "report_stats"
    pretrain(cfg)
    stats = [e for e in _events(cfg) if e["event"] == "rerun_stats"]
    assert len(stats) == ITERS  # log_interval 1
    assert all(s["reruns"] == 1 and s["max_relative_diff"] == 0.0 for s in stats)
    assert losses_by_iteration(cfg) == reference_losses  # the re-runs change nothing


def test_report_stats_sees_injected_nondeterminism(tmp_path: Path) -> None:
    noise = torch.Generator().manual_seed(7)  # not part of the RNG state the machine restores

    def noisy_forward_step(state, data_iterator, model, return_schedule_plan=False):
        output, loss_func = forward_step(state, data_iterator, model)

        def noisy_loss(output_tensor):
            loss, num_tokens, report = loss_func(output_tensor)
            jitter = 1 + 1e-6 * torch.randn((), generator=noise)
            return loss * jitter, num_tokens, {k: v * jitter for k, v in report.items()}

        return output, noisy_loss

    cfg = resilience_config(tmp_path, "noisy", 3)
    cfg.rerun_state_machine.rerun_mode = "report_stats"
    pretrain(cfg, noisy_forward_step)
    stats = [e for e in _events(cfg) if e["event"] == "rerun_stats"]
    assert len(stats) == 3 and all(s["max_relative_diff"] > 0 and s["nonzero_diffs"] == 1 for s in stats)


def test_spiky_loss_is_flagged_not_fatal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from longspan.training.resilience import rerun

    monkeypatch.setattr(rerun.RerunStateMachine, "__init__", _with_short_spike_window(rerun.RerunStateMachine.__init__))
    cfg = resilience_config(tmp_path, "spiky", 5)
    cfg.rerun_state_machine.check_for_spiky_loss = True
    cfg.rerun_state_machine.spiky_loss_factor = 1.0001  # any loss above the first ones' maximum is a "spike"

    def spiking_forward_step(state, data_iterator, model, return_schedule_plan=False):
        output, loss_func = forward_step(state, data_iterator, model)
        factor = 10.0 if state.train_state.step == 3 else 1.0  # iteration 4 spikes

        def loss(output_tensor):
            value, num_tokens, report = loss_func(output_tensor)
            return value * factor, num_tokens, {k: v * torch.tensor([factor, 1.0]) for k, v in report.items()}

        return output, loss

    state = pretrain(cfg, spiking_forward_step)
    assert getattr(state, "exit_code", None) is None and state.train_state.step == 5
    spikes = [e for e in _events(cfg) if "spiky loss" in e["message"]]
    assert [e["iteration"] for e in spikes] == [4]


def _with_short_spike_window(init):
    def patched(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.spiky_num_samples = 2

    return patched


@pytest.mark.slow
def test_cli_exit_code_17(tmp_path: Path) -> None:
    cfg = _injected(tmp_path, "transient_error")
    result = run(["pretrain", "--config", str(write_yaml(cfg, tmp_path / "t.yaml"))])
    assert result.returncode == 17, result.stderr[-2000:]


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("rerun_mode", "sometimes", "rerun_mode"),
        ("error_injection_type", "cosmic_ray", "error_injection_type"),
        ("error_injection_rate", 3, "needs rerun_state_machine.rerun_mode='validate_results'"),
        ("spiky_loss_factor", 0.5, "spiky_loss_factor"),
    ],
)
def test_bad_rerun_settings_are_rejected(tmp_path: Path, field: str, value: Any, match: str) -> None:
    cfg = resilience_config(tmp_path, "bad", 3)
    setattr(cfg.rerun_state_machine, field, value)
    with pytest.raises(ConfigError, match=match):
        cfg.validate(world_size=1)
