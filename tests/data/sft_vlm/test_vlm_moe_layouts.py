"""Expert parallel for Qwen3-VL with experts (``Qwen3VLMoeForConditionalGeneration``, a tiny random model made
here): finetuning it with its experts split over two ranks (EP2: all-to-all dispatch, the encoder, mergers and
DeepStack mergers replicated) on image questions mixed with text-only ones logs the losses and gradient norms of
one process over 8 iterations."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from tests.data.sft_vlm.conftest import colour_rows, run_counting_sharded_experts, write_jsonl
from tests.data.sft_vlm.test_qwen3_vl_finetune import LAYOUT_ITERS, REL, _sft_config


@pytest.fixture(scope="module")
def qwen3_vl_moe_inputs(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny random Qwen3-VL-MoE HF directory (4 experts, top 2; layer 1 dense) and colour questions, half of
    them (in pairs) without an image, so some microbatches hold no image."""
    from tests.models.vlm.qwen3_vl_fixtures import make_qwen3_vl

    root = tmp_path_factory.mktemp("qwen3-vl-moe")
    hf, data = root / "hf", root / "data"
    hf.mkdir()
    make_qwen3_vl(hf, moe=True)
    rows = colour_rows(str(data), 16, seed=1)
    for i, row in enumerate(rows):  # words of the fixture tokenizer's vocabulary
        row["messages"][0]["content"][1]["text"] = "what colour"
        row["messages"][2:] = []
        if i % 4 >= 2:
            row["messages"][0]["content"] = [{"type": "text", "text": "what colour"}]
    write_jsonl(str(data / "training.jsonl"), rows)
    write_jsonl(str(data / "validation.jsonl"), rows[:4])
    return hf, data


def finetune_counting_sharded_experts(cfg: Any) -> int:
    """``finetune(cfg)`` through ``run_counting_sharded_experts``."""
    from longspan.training.finetune import finetune

    return run_counting_sharded_experts(finetune, cfg)


def _losses_and_norms(cfg: Any) -> dict[int, tuple[float, float]]:
    from tests.training.pretrain_helpers import read_metrics

    return {r["iteration"]: (r["losses"]["lm loss"], r["grad_norm"]) for r in read_metrics(cfg)}


@pytest.mark.slow
def test_qwen3_vl_moe_under_expert_parallel_logs_the_losses_and_grad_norms_of_one_process(qwen3_vl_moe_inputs,
                                                                                          tmp_path, pool2):
    hf, data = qwen3_vl_moe_inputs
    reference = _sft_config(hf, data, tmp_path / "one")
    assert finetune_counting_sharded_experts(reference) == 0
    want = _losses_and_norms(reference)
    assert sorted(want) == list(range(1, LAYOUT_ITERS + 1)) and want[LAYOUT_ITERS][0] < want[1][0]

    cfg = _sft_config(hf, data, tmp_path / "ep2", ("model.expert_model_parallel_size=2",))
    # the two MoE layers' (fc1, gate, fc2) expert weights split by expert on each rank
    assert pool2.run(finetune_counting_sharded_experts, cfg, timeout=300) == [6, 6]
    got = _losses_and_norms(cfg)
    assert sorted(got) == sorted(want)
    for it, (loss, norm) in want.items():
        assert math.isclose(got[it][0], loss, rel_tol=REL), f"EP2 iteration {it} loss: {got[it][0]} vs {loss}"
        assert math.isclose(got[it][1], norm, rel_tol=REL), f"EP2 iteration {it} grad norm: {got[it][1]} vs {norm}"
