"""GLM-4.5 MoE (imported from a tiny random HF directory: partial RoPE, q/k/v biases, QK-norm, a dense first
layer, group-limited sigmoid routing with non-zero routing biases that move every step, a shared expert) trained
by ``pretrain`` under expert parallel 2 on 2 ranks gives one process's per-iteration losses and grad norms
(relative 1e-5 over 8 iterations)."""

from __future__ import annotations

import math

import pytest

from tests.parallel.harness import get_shared_pool
from tests.parallel.test_moe_parity import moe_config

ITERS = 8
REL_TOL = 1e-5


def _glm_pretrain_task(run_dir: str, hf_dir: str, ep: int = 1) -> None:
    from longspan.training.pretrain import pretrain

    cfg = moe_config(ep=ep)  # layout, mock data and batch sizes; the architecture is config.json's
    cfg.checkpoint.pretrained_checkpoint = hf_dir
    cfg.train.train_iters = ITERS
    cfg.train.eval_interval = None
    cfg.train.eval_iters = 0
    cfg.checkpoint.save = None
    cfg.checkpoint.load = None
    cfg.logger.tensorboard_dir = run_dir
    cfg.logger.log_interval = 1
    pretrain(cfg)


def _logged(run_dir: str) -> list[dict]:
    import json
    import os

    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    return [r for r in rows if r.get("phase") == "train"]


@pytest.mark.slow
def test_glm_pretrain_ep2_matches_one_process(tmp_path):
    from tests.conversion.glm_models import make_glm_model

    hf_dir = tmp_path / "hf"
    make_glm_model(hf_dir, tokenizer=False, vocab_size=256)
    reference_dir, ep2_dir = tmp_path / "one", tmp_path / "ep2"
    _glm_pretrain_task(str(reference_dir), str(hf_dir))
    get_shared_pool(2).run(_glm_pretrain_task, str(ep2_dir), str(hf_dir), 2, timeout=300)
    ref, got = _logged(str(reference_dir)), _logged(str(ep2_dir))
    assert [r["iteration"] for r in got] == list(range(1, ITERS + 1)) == [r["iteration"] for r in ref]
    for key in ("lm loss",):
        for r, w in zip(got, ref):
            assert math.isclose(r["losses"][key], w["losses"][key], rel_tol=REL_TOL), (r["iteration"], key)
    for r, w in zip(got, ref):
        assert math.isclose(r["grad_norm"], w["grad_norm"], rel_tol=REL_TOL), r["iteration"]
    assert ref[-1]["losses"]["lm loss"] < ref[0]["losses"]["lm loss"]
