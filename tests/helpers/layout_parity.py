"""Layout-parity set-ups: run the real trainer on one process and under a parallel layout, compare the logs.

A parity test keeps its own config builder and worker task (``task(run_dir, **layout)``, picklable, run
in the test process for the reference and on the shared worker pool for the layout); these helpers read
what the runs logged and compare it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Iterable

import pytest

from tests.parallel.harness import get_shared_pool
from tests.training.pretrain_helpers import losses_by_iteration

# The 2-process layouts of a GPT-like model: keyword arguments of the tests' config builders.
TWO_PROCESS_LAYOUTS = {
    "tp2": dict(tp=2),
    "tp2_sp": dict(tp=2, sp=True),
    "pp2": dict(pp=2),
    "dp2_fsdp2": dict(fsdp2=True),
    "cp2": dict(cp=2),
}


def train_records(tb_dir: str) -> list[dict]:
    """The per-iteration training records of ``tb_dir``/metrics.jsonl (validation and events left out)."""
    rows = [json.loads(line) for line in open(os.path.join(tb_dir, "metrics.jsonl"))]
    return [r for r in rows if r.get("phase") == "train"]


def logged(tb_dir: str) -> dict:
    """Per-iteration training losses and gradient norms from ``tb_dir``/metrics.jsonl."""
    rows = train_records(tb_dir)
    return {"iterations": [r["iteration"] for r in rows], "losses": [r["losses"]["lm loss"] for r in rows],
            "norms": [r["grad_norm"] for r in rows]}


def moe_variant_references(tmp_path_factory: pytest.TempPathFactory, pretrain: Callable[..., int],
                           iters: int) -> Callable[[bool], dict]:
    """``reference(moe)``: the one-process run of a model (``moe=False``) or of its MoE variant, as ``logged``
    reads it, trained once each (``pretrain(run_dir, moe=moe)`` must reach ``iters``) when first asked."""
    runs: dict[bool, dict] = {}

    def reference(moe: bool) -> dict:
        if moe not in runs:
            run_dir = str(tmp_path_factory.mktemp("moe" if moe else "dense"))
            assert pretrain(run_dir, moe=moe) == iters
            runs[moe] = logged(os.path.join(run_dir, "tb"))
        return runs[moe]

    return reference


def one_process_losses(task: Callable[..., int], config: Callable[[str], Any], run_dir: str,
                       iters: int) -> dict[int, float]:
    """The reference: ``task(run_dir)`` in this process trains ``iters`` iterations; the losses it logged."""
    assert task(run_dir) == iters
    return losses_by_iteration(config(run_dir))


def layout_losses(task: Callable[..., int], config: Callable[[str], Any], run_dir: str, layout: dict[str, Any],
                  world_size: int = 2, timeout: float = 300) -> dict[int, float]:
    """``task(run_dir, **layout)`` on the shared pool of ``world_size`` processes; the losses it logged."""
    get_shared_pool(world_size).run(task, run_dir, timeout=timeout, **layout)
    return losses_by_iteration(config(run_dir))


def assert_losses_match(got: dict[int, float], want: dict[int, float], iterations: Iterable[int], rel: float,
                        label: Any = None) -> None:
    """``got`` logged exactly ``iterations``, each loss within ``rel`` (relative) of ``want``'s."""
    iterations = list(iterations)
    assert sorted(got) == iterations
    for it in iterations:
        assert got[it] == pytest.approx(want[it], rel=rel), (label, it, got[it], want[it])


def assert_layout_matches_one_process(name: str, want: dict[int, float], task: Callable[..., int],
                                      config: Callable[[str], Any], run_dir: str, iters: int, rel: float) -> None:
    """The 2-process layout ``TWO_PROCESS_LAYOUTS[name]`` logs the one-process losses ``want`` (``rel``) in each of
    ``iters`` iterations; ``want`` itself must fall by 5% (a layout training another model would show)."""
    assert want[iters] < want[1] * 0.95
    got = layout_losses(task, config, run_dir, TWO_PROCESS_LAYOUTS[name])
    assert_losses_match(got, want, range(1, iters + 1), rel, name)


def import_export_under_layout(hf_dir: Path, layout: dict[str, Any], fsdp: bool,
                               save_dir: Path) -> tuple[dict, dict]:
    """Import the HF directory ``hf_dir`` under ``layout`` (and FSDP2) on the 2-process pool, run 2 × 12 tokens
    through it and export it (also saving to ``save_dir``): every rank's logits equal one process's (1e-5), and
    the ranks' exports together name the tensors of one process's export and of the checkpoint. Returns (the
    merged export, the checkpoint's tensors)."""
    import torch

    from tests.conversion.hf_models import VOCAB
    from tests.conversion.test_layouts import _import_forward_export, _one_process, _original

    tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(4))
    expected, expected_export = _one_process(hf_dir, tokens)
    results = get_shared_pool(2).run(_import_forward_export, str(hf_dir), layout, fsdp, tokens, str(save_dir),
                                     timeout=180)
    logits = [r[0] for r in results if r[0] is not None]
    assert logits
    for got in logits:
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    merged: dict[str, torch.Tensor] = {}
    for _, exported, _, _ in results:
        merged.update(exported)
    original = _original(hf_dir)
    assert sorted(merged) == sorted(original) == sorted(expected_export)
    return merged, original
