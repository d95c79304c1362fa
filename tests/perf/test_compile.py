"""The compiled fast path (train.torch_compile, longspan.parallel.compile): compiled and eager training give
the same losses (fp32 CPU, dropout on, rel <= 1e-5 over 20 iterations) in one process and DP2, a compiled run
resumes bit for bit, the platform check falls back to eager with one line, and the default is resolved per
device. The other layouts (TP2/SP, PP2, FSDP2, CP2, MoE EP2, recompute) are in test_compile_layouts.py.

Compiling on the shared 2-core machine is slow, so the models are tiny and the runs short; inductor's
on-disk cache makes the later compiles of the same graphs cheap."""

from __future__ import annotations

import logging

import pytest
import torch

from longspan.parallel import compile as compile_mod
from tests.training.pretrain_helpers import losses_by_iteration, small_config

ITERS = 20  # the acceptance's 20 iterations
SAVE_AT = 10  # resumed runs start here


def compile_config(tmp_path, name, compiled, **train):
    """A 2-layer, hidden-32 model on mock data, dropout on, end-of-document positions out of the loss (uneven
    mask counts per microbatch), ``ITERS`` iterations, a checkpoint at ``SAVE_AT``."""
    cfg = small_config(tmp_path, name, train_iters=ITERS, eval_interval=100, eval_iters=0, **train)
    m = cfg.model
    m.hidden_dropout = m.attention_dropout = 0.1  # fallback_random: the same masks as eager
    m.hidden_size, m.ffn_hidden_size, m.seq_length = 32, 64, 32
    cfg.dataset.sequence_length = 32
    cfg.dataset.eod_mask_loss = True
    cfg.train.torch_compile = compiled
    cfg.checkpoint.save_interval = SAVE_AT
    return cfg



def assert_rel_close(got, want, rel=1e-5, iters=ITERS):
    """Same ``iters`` iterations, and every loss within ``rel`` of the reference; returns the largest relative
    gap."""
    assert sorted(got) == sorted(want) and len(want) == iters
    gaps = {it: abs(got[it] - want[it]) / abs(want[it]) for it in want}
    worst = max(gaps, key=gaps.get)
    assert gaps[worst] <= rel, (worst, got[worst], want[worst])
    return gaps[worst]



@pytest.mark.slow
def test_compiled_equals_eager_and_resumes_bit_for_bit(tmp_path, caplog, capsys):
    from longspan.training.pretrain import pretrain

    eager = compile_config(tmp_path, "eager", False)
    pretrain(eager)
    compiled = compile_config(tmp_path, "compiled", True)
    with caplog.at_level(logging.INFO):
        state = pretrain(compiled)
    assert state.compiled
    text = caplog.text + capsys.readouterr().out
    assert "fp32, compiled layers" in text and "torch.compile warm-up:" in text
    reference = losses_by_iteration(compiled)
    gap = assert_rel_close(reference, losses_by_iteration(eager))
    print(f"compiled vs eager (one process): max rel {gap:.1e}; "
          + next(line for line in text.splitlines() if "warm-up" in line))

    resumed = compile_config(tmp_path, "resumed", True)
    resumed.checkpoint.load = compiled.checkpoint.save
    resumed.checkpoint.ckpt_step = SAVE_AT
    pretrain(resumed)
    again = losses_by_iteration(resumed)
    later = range(SAVE_AT + 1, ITERS + 1)
    assert sorted(again) == list(later)
    assert [again[i] for i in later] == [reference[i] for i in later]


def _dp2_losses(run_dir: str, compiled: bool) -> dict:
    from pathlib import Path

    from longspan.training.pretrain import pretrain

    cfg = compile_config(Path(run_dir), "dp2", compiled)
    cfg.checkpoint.save = cfg.checkpoint.load = None
    cfg.dist.distributed_backend, cfg.dist.distributed_timeout_minutes = "gloo", 5
    pretrain(cfg)
    return losses_by_iteration(cfg) if torch.distributed.get_rank() == 0 else {}


@pytest.mark.slow
def test_compiled_dp2_equals_eager_dp2(tmp_path, pool2):
    """DDP over 2 ranks, dropout on (per-rank masks, so the reference is eager DP2, not one process)."""
    eager = pool2.run(_dp2_losses, str(tmp_path / "eager"), False, timeout=600)[0]
    compiled = pool2.run(_dp2_losses, str(tmp_path / "compiled"), True, timeout=600)[0]
    print(f"compiled vs eager (DP2): max rel {assert_rel_close(compiled, eager):.1e}")


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


def _tiny_model(**model_overrides):
    from longspan.models.gpt import build_gpt_model
    from tests.parallel.test_layout_parity import tiny_config

    cfg = tiny_config(seq=16, num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                      num_query_groups=2, **model_overrides)
    cfg.model.finalize()
    return build_gpt_model(cfg.model, materialize=False)


@pytest.mark.parametrize("overrides,tp,compiled_blocks", [
    (dict(), 2, ["layer"]),  # nothing eager: the whole layer, also under TP
    (dict(recompute_granularity="selective"), 1, ["layer"]),  # core eager: a graph break in the layer
    (dict(recompute_granularity="selective"), 2, ["mlp"]),  # TP: no break inside a compiled graph
    (dict(num_moe_experts=4, moe_ffn_hidden_size=32), 1, ["layer"]),
    (dict(num_moe_experts=4, moe_ffn_hidden_size=32), 2, ["self_attention"]),
    # TP, MoE and selective recompute: attention and MLP both eager, nothing left: the run is eager
    (dict(num_moe_experts=4, moe_ffn_hidden_size=32, recompute_granularity="selective"), 2, []),
])
def test_what_compiles_per_layer(overrides, tp, compiled_blocks):
    """Which forwards ``compile_model`` replaces (lazily: nothing compiles until called), and that the eager
    parts (checkpointed attention core, MoE dispatch) are wrapped to stay out of the graphs."""
    model = _tiny_model(**overrides)
    done = compile_mod.compile_model([model], True, torch.device("cpu"), tensor_parallel=tp)
    assert done is bool(compiled_blocks)
    for layer in model.decoder.layers.values():
        blocks = {"layer": layer, "self_attention": layer.self_attention, "mlp": layer.mlp}
        assert sorted(name for name, block in blocks.items() if "forward" in vars(block)) == compiled_blocks
        attention, mlp = layer.self_attention, layer.mlp
        if "recompute_granularity" in overrides:
            assert attention.core_attention is not compile_mod.core_attention  # wrapped by compiler.disable
            assert attention.core_attention.__wrapped__ is compile_mod.core_attention
        if getattr(mlp, "is_moe", False):
            assert "dispatch_and_combine" in vars(mlp.token_dispatcher)
