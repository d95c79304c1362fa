"""The start-up banner says where the weights came from; the end-of-run summary reports this run's part and the
final loss the last log line printed; a resume with nothing left to train says so and writes nothing."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from longspan.cli import main
from longspan.training.finetune import finetune
from longspan.training.observability.run_summary import final_loss_text
from longspan.training.pretrain import pretrain
from longspan.training.step.forward_step import forward_step
from tests.conversion.hf_models import make_hf_model
from tests.training.pretrain_helpers import losses_by_iteration, small_config

BANNER = "parameters | world size"


def _lines(capsys: pytest.CaptureFixture) -> list[str]:
    return capsys.readouterr().out.splitlines()


def _run(entry, cfg, capsys: pytest.CaptureFixture) -> tuple[str, str]:
    """(banner line, summary line) of one run (longspan's log lines go to stdout)."""
    capsys.readouterr()
    entry(cfg, forward_step)
    lines = _lines(capsys)
    banner = [m for m in lines if m.startswith("longspan: ") and BANNER in m]
    summary = [m for m in lines if m.startswith(("longspan: done:", "longspan: nothing to train"))]
    assert len(banner) == 1 and len(summary) == 1, (banner, summary)
    assert not any("resuming" in m and "iteration 0" in m for m in lines), lines
    return banner[0], summary[0]


def _files(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``root``: size and modification time (a rewrite changes the time)."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


def test_banner_names_the_weights_and_a_finished_checkpoint_trains_nothing(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture) -> None:
    cfg = small_config(tmp_path, "run", train_iters=2, eval_interval=100)
    cfg.logger.log_progress = True
    banner, summary = _run(pretrain, cfg, capsys)
    assert banner.endswith("| starting from scratch")
    assert summary.startswith("longspan: done: 2 iterations in ") and "final lm loss " in summary

    # the same command again, through the CLI: the checkpoint is at train_iters already
    run_dir = tmp_path / "run"
    before = _files(run_dir)
    assert (run_dir / "ckpt" / "progress.txt").is_file() and (run_dir / "tb" / "metrics.jsonl").is_file()
    yaml_path = tmp_path / "run.yaml"
    cfg.to_yaml(str(yaml_path))
    capsys.readouterr()
    assert main(["pretrain", "--config", str(yaml_path)]) == 0
    lines = _lines(capsys)
    ckpt = run_dir / "ckpt"
    assert [m for m in lines if BANNER in m][0].endswith(f"| resuming from {ckpt / 'iter_0000002'} at iteration 2")
    ends = [m for m in lines if m.startswith(("longspan: done", "longspan: nothing"))]
    assert ends == ["longspan: nothing to train: the checkpoint is at iteration 2 = train.train_iters; "
                    "raise train.train_iters to continue"], lines
    assert not any("iteration " in m and "consumed samples" in m for m in lines)  # no training log line
    assert not any("validation loss" in m for m in lines)  # no test evaluation either
    assert _files(run_dir) == before  # no checkpoint rewritten, no progress entry, no metrics

    # evaluation only: no training numbers
    cfg.train.skip_train = True
    _, summary = _run(pretrain, cfg, capsys)
    assert summary.startswith("longspan: done: evaluation only (train.skip_train=True) at iteration 2 in ")

    # training on, stopped by exit_interval: only this run's iterations are counted, and the stop is named
    cfg = small_config(tmp_path, "run", train_iters=5, eval_interval=100, exit_interval=4)
    cfg.scheduler.override_opt_param_scheduler = True  # a longer run: the schedule stretches with it
    _, summary = _run(pretrain, cfg, capsys)
    assert summary.startswith("longspan: done: iterations 3-4 (stopped before train.train_iters=5) in ")
    assert "(iteration 4, the last log line)" in summary  # log_interval=1: the window is the last iteration

    # weights only, from another run's checkpoint: finetune starts at iteration 0 and says from where
    cfg = small_config(tmp_path, "ft", train_iters=1, eval_interval=100)
    cfg.checkpoint.load = None
    cfg.checkpoint.pretrained_checkpoint = str(ckpt)
    banner, summary = _run(finetune, cfg, capsys)
    assert banner.endswith(f"| weights from pretrained checkpoint {ckpt / 'iter_0000004'} (iteration 4), "
                           "starting at iteration 0")
    assert summary.startswith("longspan: done: 1 iteration in ")

    # weights from a Hugging Face directory
    hf_dir = tmp_path / "hf"
    make_hf_model("llama", hf_dir)
    cfg = small_config(tmp_path, "hf-run", train_iters=1, eval_interval=100, eval_iters=0)
    cfg.checkpoint.load = None
    cfg.checkpoint.pretrained_checkpoint = str(hf_dir)
    cfg.dataset.sequence_length = cfg.model.seq_length = 32
    banner, _ = _run(finetune, cfg, capsys)
    assert banner.endswith(f"| weights from HF directory {hf_dir}, starting at iteration 0")


def test_final_lm_loss_is_the_last_log_line_and_names_its_window(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture) -> None:
    """log_interval=3, 7 iterations: lines at 3 and 6 (Megatron's iterations divisible by the interval); the
    summary's final loss is the line at 6, the mean over iterations 4-6, and it says so."""
    cfg = small_config(tmp_path, "run", train_iters=7, eval_interval=100, eval_iters=0)
    cfg.logger.log_interval = 3
    capsys.readouterr()
    pretrain(cfg, forward_step)
    lines = _lines(capsys)
    logged = [re.search(r"iteration +(\d+)/ +7 \|.* lm loss: ([0-9.E+-]+) \|", m) for m in lines]
    logged = [(int(m.group(1)), m.group(2)) for m in logged if m]
    assert [it for it, _ in logged] == [3, 6]
    summary = [m for m in lines if m.startswith("longspan: done:")]
    assert len(summary) == 1
    assert f"final lm loss {logged[-1][1]} (mean of iterations 4-6, the last log line)" in summary[0], summary[0]
    per_iteration = losses_by_iteration(cfg)
    window_mean = sum(per_iteration[i] for i in (4, 5, 6)) / 3
    assert float(logged[-1][1]) == pytest.approx(window_mean, rel=2e-6)
    assert abs(per_iteration[7] - window_mean) > 1e-6  # iteration 7 is not in it (and would change the number)


def test_final_loss_without_a_log_line_says_why() -> None:
    def state(**logger):
        cfg = SimpleNamespace(logger=SimpleNamespace(**{"skip_train_metrics_log": False, "log_interval": 100,
                                                        **logger}))
        return SimpleNamespace(cfg=cfg, train_state=SimpleNamespace(step=7), start_iteration=0)

    assert final_loss_text(state()) == (
        "final loss n/a (no training log line: logger.log_interval=100, 7 iterations trained)")
    assert final_loss_text(state(skip_train_metrics_log=True)) == (
        "final loss n/a (logger.skip_train_metrics_log=True: no training log line)")


def test_peft_banner_names_the_base_and_whether_adapters_are_new_or_resumed(tmp_path: Path) -> None:
    from longspan.config.schema.training import CheckpointConfig
    from longspan.training.setup import weights_source

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    resumed = SimpleNamespace(directory=tmp_path / "ckpt" / "iter_0000050", iteration=50, finetune=False)
    cfg = SimpleNamespace(checkpoint=CheckpointConfig(pretrained_checkpoint=str(hf), load=str(tmp_path / "ckpt")),
                          peft=object())
    assert weights_source(cfg, None) == f"weights from HF directory {hf}, new adapters, starting at iteration 0"
    assert weights_source(cfg, resumed) == (
        f"resuming from {resumed.directory} at iteration 50 (base weights from HF directory {hf})")
