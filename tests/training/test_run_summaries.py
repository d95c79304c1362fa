"""The start-up banner says where the weights came from; the end-of-run summary reports this run's part, and a
resume with nothing left to train says so."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from longspan.training.step.forward_step import forward_step
from longspan.training.pretrain import pretrain
from longspan.training.setup import weights_source
from tests.training.pretrain_helpers import small_config


def _run(cfg, capsys: pytest.CaptureFixture) -> tuple[str, str]:
    """(banner line, summary line) of one run (longspan's log lines go to stdout)."""
    capsys.readouterr()
    pretrain(cfg, forward_step)
    lines = capsys.readouterr().out.splitlines()
    banner = [m for m in lines if m.startswith("longspan: ") and "parameters | world size" in m]
    summary = [m for m in lines if m.startswith(("longspan: done:", "longspan: nothing to train"))]
    assert len(banner) == 1 and len(summary) == 1, (banner, summary)
    return banner[0], summary[0]


def test_banner_and_summary_across_scratch_resume_and_pretrained(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture) -> None:
    cfg = small_config(tmp_path, "run", train_iters=2, eval_interval=100)
    banner, summary = _run(cfg, capsys)
    assert banner.endswith("| starting from scratch")
    assert summary.startswith("longspan: done: 2 iterations in ") and "final lm loss" in summary

    # the same command again: the checkpoint is at train_iters already
    banner, summary = _run(small_config(tmp_path, "run", train_iters=2, eval_interval=100), capsys)
    ckpt = tmp_path / "run" / "ckpt"
    assert banner.endswith(f"| resuming {ckpt / 'iter_0000002'} at iteration 2")
    assert summary == (
        "longspan: nothing to train: checkpoint at iteration 2 >= train.train_iters=2 (raise train.train_iters to "
        f"train on, or give checkpoint.load=null or another checkpoint.save to start fresh); checkpoints in {ckpt}; "
        f"TensorBoard logs in {tmp_path / 'run' / 'tb'}"
    )

    # training on: only this run's iterations are counted
    cfg = small_config(tmp_path, "run", train_iters=4, eval_interval=100)
    cfg.scheduler.override_opt_param_scheduler = True  # a longer run: the schedule stretches with it
    _, summary = _run(cfg, capsys)
    assert summary.startswith("longspan: done: iterations 3-4 in ")

    # weights only from another run's checkpoint
    cfg = small_config(tmp_path, "ft", train_iters=1, eval_interval=100)
    cfg.checkpoint.load = None
    cfg.checkpoint.pretrained_checkpoint = str(ckpt)
    banner, summary = _run(cfg, capsys)
    assert banner.endswith(f"| weights from the pretrained checkpoint {ckpt}, starting at iteration 0")
    assert summary.startswith("longspan: done: 1 iterations in ")


def test_weights_source_names_hf_directories_and_peft_bases(tmp_path: Path) -> None:
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    loaded_hf = SimpleNamespace(directory=hf, iteration=0, finetune=True)
    resumed = SimpleNamespace(directory=tmp_path / "ckpt" / "iter_0000050", iteration=50, finetune=False)

    def cfg(pretrained, peft=None):
        return SimpleNamespace(checkpoint=SimpleNamespace(pretrained_checkpoint=pretrained), peft=peft)

    assert weights_source(cfg(str(hf)), loaded_hf) == f"weights from the Hugging Face model {hf}, starting at iteration 0"
    assert weights_source(cfg(str(hf), peft=object()), None) == (
        f"weights from the Hugging Face model {hf}, new adapters, starting at iteration 0")
    assert weights_source(cfg(str(hf), peft=object()), resumed) == (
        f"resuming {resumed.directory} at iteration 50 (base weights from the Hugging Face model {hf})")
    assert weights_source(cfg(None), resumed) == f"resuming {resumed.directory} at iteration 50"
    assert weights_source(cfg(None), None) == "starting from scratch"
