"""The compiled fast path (train.torch_compile, longspan.training.compile): compiled and eager training give
the same losses (fp32 CPU, dropout on, rel <= 1e-5) in one process and DP2, a compiled run resumes bit for
bit, the platform check falls back to eager with one line, and the default is resolved per device.

Compiling on the shared 2-core machine is slow, so the models are tiny and the runs short; inductor's
on-disk cache makes the later compiles of the same graphs cheap."""

from __future__ import annotations

import logging

import pytest
import torch

from longspan.training import compile as compile_mod
from tests.training.pretrain_helpers import losses_by_iteration, small_config

ITERS = 4


def _config(tmp_path, name, compiled, **train):
    cfg = small_config(tmp_path, name, train_iters=ITERS, eval_interval=100, eval_iters=0, **train)
    m = cfg.model
    m.hidden_dropout = m.attention_dropout = 0.1  # fallback_random: the same masks as eager
    m.hidden_size, m.ffn_hidden_size, m.seq_length = 32, 64, 32
    cfg.dataset.sequence_length = 32
    cfg.train.torch_compile = compiled
    cfg.checkpoint.save_interval = 2
    return cfg


def _assert_rel_close(got, want, rel=1e-5):
    assert sorted(got) == sorted(want)
    for it in want:
        assert abs(got[it] - want[it]) <= rel * abs(want[it]), (it, got[it], want[it])


@pytest.mark.slow
def test_compiled_equals_eager_and_resumes_bit_for_bit(tmp_path, caplog, capsys):
    from longspan.training.pretrain import pretrain

    eager = _config(tmp_path, "eager", False)
    pretrain(eager)
    compiled = _config(tmp_path, "compiled", True)
    with caplog.at_level(logging.INFO):
        state = pretrain(compiled)
    assert state.compiled
    text = caplog.text + capsys.readouterr().out
    assert "fp32, compiled layers" in text and "torch.compile warm-up:" in text
    reference = losses_by_iteration(compiled)
    _assert_rel_close(reference, losses_by_iteration(eager))

    resumed = _config(tmp_path, "resumed", True)
    resumed.checkpoint.load = compiled.checkpoint.save
    resumed.checkpoint.ckpt_step = 2
    pretrain(resumed)
    again = losses_by_iteration(resumed)
    assert [again[i] for i in (3, 4)] == [reference[i] for i in (3, 4)]


def _dp2_losses(run_dir: str, compiled: bool) -> dict:
    from pathlib import Path

    from longspan.training.pretrain import pretrain

    cfg = _config(Path(run_dir), "dp2", compiled)
    cfg.checkpoint.save = cfg.checkpoint.load = None
    cfg.dist.distributed_backend, cfg.dist.distributed_timeout_minutes = "gloo", 5
    pretrain(cfg)
    return losses_by_iteration(cfg) if torch.distributed.get_rank() == 0 else {}


@pytest.mark.slow
def test_compiled_dp2_equals_eager_dp2(tmp_path, pool2):
    """DDP over 2 ranks, dropout on (per-rank masks, so the reference is eager DP2, not one process)."""
    eager = pool2.run(_dp2_losses, str(tmp_path / "eager"), False, timeout=600)[0]
    compiled = pool2.run(_dp2_losses, str(tmp_path / "compiled"), True, timeout=600)[0]
    _assert_rel_close(compiled, eager)


def test_no_compiler_falls_back_to_eager_with_one_line(monkeypatch, caplog):
    monkeypatch.setattr(compile_mod.shutil, "which", lambda name: None)
    layer = torch.nn.Linear(2, 2)
    chunk = torch.nn.Module()
    chunk.decoder = torch.nn.Module()
    chunk.decoder.layers = torch.nn.ModuleDict({"0": layer})
    with caplog.at_level(logging.WARNING):
        assert compile_mod.compile_model([chunk], True, torch.device("cpu")) is False
    lines = [r.getMessage() for r in caplog.records if "torch_compile" in r.getMessage()]
    assert lines == ["train.torch_compile: no C++ compiler (g++, c++ or clang++) on PATH; training runs eager "
                     "(set train.torch_compile=False to silence this)"]
    assert "forward" not in vars(layer)  # untouched


def test_default_resolution():
    assert compile_mod.compile_enabled(None, torch.device("cuda")) is True
    assert compile_mod.compile_enabled(None, torch.device("cpu")) is compile_mod.CPU_DEFAULT
    assert compile_mod.compile_enabled(False, torch.device("cuda")) is False
    assert compile_mod.compile_enabled(True, torch.device("cpu")) is True


def test_tensor_parallel_is_not_compiled_yet():
    from longspan.core.errors import NotSupportedError

    chunk = torch.nn.Module()
    chunk.decoder = torch.nn.Module()
    chunk.decoder.layers = torch.nn.ModuleDict({"0": torch.nn.Linear(2, 2)})
    with pytest.raises(NotSupportedError, match="train.torch_compile=True with tensor_model_parallel_size=2"):
        compile_mod.compile_model([chunk], True, torch.device("cpu"), tensor_parallel=2)
    assert compile_mod.compile_model([chunk], None, torch.device("cpu"), tensor_parallel=2) is False
