"""MFU: the peak table and its override, the MFU field of the training log line and metrics.jsonl, and the
end-of-run summary's tokens/s/device and MFU, on a real (tiny) pretrain run."""

from __future__ import annotations

import logging
import re

import pytest
import torch

from longspan.core.errors import ConfigError
from longspan.planner import peak_flops as mfu_mod
from longspan.training.observability.log_format import format_training_log_line
from tests.training.pretrain_helpers import read_metrics, small_config


def test_peak_table_and_override(monkeypatch):
    monkeypatch.delenv(mfu_mod.PEAK_TFLOPS_ENV, raising=False)
    assert mfu_mod.PEAK_BF16_TFLOPS["h100"] == pytest.approx(989.4)
    assert set(mfu_mod.PEAK_BF16_TFLOPS) >= {"h100", "h200", "a100", "b200"}
    assert mfu_mod.device_kind(torch.device("cpu")) == "cpu"
    measured = mfu_mod.peak_flops_per_device(torch.device("cpu"))
    assert measured > 1e8  # a measured matmul rate on this CPU
    monkeypatch.setenv(mfu_mod.PEAK_TFLOPS_ENV, "2.5")
    assert mfu_mod.peak_flops_per_device(torch.device("cpu")) == 2.5e12
    assert mfu_mod.mfu(1e12, 2.5e12) == pytest.approx(0.4)
    assert mfu_mod.mfu(None, 1.0) is None and mfu_mod.mfu(1.0, None) is None
    for bad in ("fast", "0", "-3"):
        monkeypatch.setenv(mfu_mod.PEAK_TFLOPS_ENV, bad)
        with pytest.raises(ConfigError, match="LONGSPAN_PEAK_TFLOPS"):
            mfu_mod.peak_flops_per_device(torch.device("cpu"))


def test_log_line_has_mfu_after_throughput():
    line = format_training_log_line(
        iteration=3, train_iters=10, consumed_samples=24, elapsed_ms=12.0, batch_size=8, losses={"lm loss": 2.0},
        loss_scale=1.0, skipped_iterations=0, nan_iterations=0, throughput=123.4, mfu=0.4123,
    )
    assert "throughput per GPU (TFLOP/s/GPU): 123.4 | MFU: 41.2% |" in line
    line = format_training_log_line(
        iteration=3, train_iters=10, consumed_samples=24, elapsed_ms=12.0, batch_size=8, losses={"lm loss": 2.0},
        loss_scale=1.0, skipped_iterations=0, nan_iterations=0,
    )
    assert "MFU" not in line


def test_pretrain_logs_mfu_and_summary(tmp_path, monkeypatch, caplog, capsys):
    from longspan.training.pretrain import pretrain

    monkeypatch.setenv(mfu_mod.PEAK_TFLOPS_ENV, "0.5")  # 0.5 TFLOP/s per device: MFU = TFLOP/s / 0.5
    cfg = small_config(tmp_path, train_iters=4, eval_interval=100, eval_iters=0)
    cfg.checkpoint.save = cfg.checkpoint.load = None
    cfg.logger.log_throughput = True
    with caplog.at_level(logging.INFO):
        pretrain(cfg)
    text = caplog.text + capsys.readouterr().out
    # the line may reach both the log capture and stdout, depending on earlier tests' logging set-up
    logged = set(re.findall(r"iteration +(\d+)/ +4 \|.*TFLOP/s/GPU\): [0-9.]+ \| MFU: [0-9.]+% \|", text))
    assert logged == {"1", "2", "3", "4"}, text
    records = read_metrics(cfg)
    timed = [r for r in records if r["iteration_time_s"]]
    assert len(timed) == 3 and all(r["mfu"] == pytest.approx(r["throughput"] / 0.5) for r in timed)
    summary = [line for line in text.splitlines() if "longspan: done" in line][-1]
    match = re.search(r"iterations 2-4: (\d+) tokens/s/device, ([0-9.e-]+) TFLOP/s/device, MFU ([0-9.]+)%", summary)
    assert match, summary
    tokens_per_s, tflops, pct = int(match.group(1)), float(match.group(2)), float(match.group(3))
    # both are rounded for print: MFU to 0.1 (±0.05), TFLOP/s to 3 significant digits (±0.05% of it)
    assert abs(pct - tflops / 0.5 * 100) <= 0.05 + 0.001 * pct + 1e-9, (pct, tflops)
    # tokens/s and FLOP/s describe the same iterations: their ratio is the model FLOPs per token
    from longspan.planner.flops import num_floating_point_operations

    flops_per_token = num_floating_point_operations(cfg, 1) / cfg.model.seq_length
    assert tflops * 1e12 / tokens_per_s == pytest.approx(flops_per_token, rel=0.01)


def test_cpu_peak_is_the_best_of_several_runs_and_dtypes(monkeypatch):
    """One run slowed by other processes does not lower the peak: the fastest run of either dtype counts."""
    rates = iter([0.0, 0.01, 0.05, 0.02, 0.0, 0.03, 0.08, 0.04])  # per dtype: warm-up, then three runs
    calls = []

    def fake_rate(size, dtype, seconds):
        calls.append((dtype, seconds))
        return next(rates)

    monkeypatch.setattr(mfu_mod, "_matmul_tflops", fake_rate)
    mfu_mod.measured_cpu_tflops.cache_clear()
    try:
        assert mfu_mod.measured_cpu_tflops(1) == 0.08
        assert [d for d, _ in calls] == [torch.float32] * 4 + [torch.bfloat16] * 4
        assert mfu_mod.measured_cpu_tflops(1) == 0.08 and len(calls) == 8  # measured once per process
    finally:
        mfu_mod.measured_cpu_tflops.cache_clear()


def test_mfu_above_the_peak_is_not_reported_as_a_number():
    assert mfu_mod.format_mfu(0.412) == "41.2%" and mfu_mod.format_mfu(1.0) == "100.0%"
    assert mfu_mod.format_mfu(1.604) == "n/a (peak too low)"
    assert mfu_mod.reported_mfu(0.5) == 0.5 and mfu_mod.reported_mfu(1.6) is None
    assert mfu_mod.reported_mfu(None) is None
    line = format_training_log_line(
        iteration=3, train_iters=10, consumed_samples=24, elapsed_ms=12.0, batch_size=8, losses={"lm loss": 2.0},
        loss_scale=1.0, skipped_iterations=0, nan_iterations=0, throughput=123.4, mfu=1.604,
    )
    assert "| MFU: n/a (peak too low) |" in line


def test_a_peak_measured_too_low_never_gives_mfu_above_100_percent(tmp_path, monkeypatch, caplog, capsys):
    """The CPU peak measured as 1 kFLOP/s (a machine swamped while measuring): the log lines and the end-of-run
    summary say the MFU is not available, metrics.jsonl holds None, no percentage above 100 appears."""
    from longspan.training.pretrain import pretrain

    monkeypatch.delenv(mfu_mod.PEAK_TFLOPS_ENV, raising=False)
    monkeypatch.setattr(mfu_mod, "measured_cpu_tflops", lambda threads: 1e-9)
    cfg = small_config(tmp_path, train_iters=3, eval_interval=100, eval_iters=0)
    cfg.checkpoint.save = cfg.checkpoint.load = None
    cfg.logger.log_throughput = True
    with caplog.at_level(logging.INFO):
        pretrain(cfg)
    text = caplog.text + capsys.readouterr().out
    assert re.search(r"iteration +3/ +3 \|.* MFU: n/a \(peak too low\) \|", text), text
    summary = [line for line in text.splitlines() if "longspan: done" in line][-1]
    assert "MFU n/a (peak too low)" in summary, summary
    percentages = [float(p) for p in re.findall(r"MFU:? ([0-9.]+)%", text)]
    assert all(p <= 100.0 for p in percentages), percentages
    timed = [r for r in read_metrics(cfg) if r["iteration_time_s"]]
    assert timed and all(r["mfu"] is None and r["throughput"] > 0 for r in timed)
