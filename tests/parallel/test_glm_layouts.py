"""GLM-4.5 MoE (a tiny random HF directory: partial RoPE, q/k/v biases, QK-norm, a dense first layer,
group-limited sigmoid routing with non-zero routing biases, a shared expert) across layouts:

- imported under EP2 (+ FSDP2), TP2 and PP2 it gives one process's logits, and its export (routing biases
  included) is bit-identical to the source;
- trained by ``pretrain`` under EP2 on 2 ranks (the routing biases move every step) it gives one process's
  per-iteration losses and grad norms (relative 1e-5 over 8 iterations).
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.conversion.glm_models import make_glm_model
from tests.conversion.test_layouts import _original
from tests.helpers.layout_parity import import_export_under_layout, train_records
from tests.parallel.harness import get_shared_pool
from tests.parallel.test_moe_parity import moe_config

ITERS = 8
REL_TOL = 1e-5


LAYOUTS = [
    ("ep2-fsdp2", {"expert_model_parallel_size": 2}, True),
    ("tp2", {"tensor_model_parallel_size": 2}, False),
    ("pp2", {"pipeline_model_parallel_size": 2}, False),
]


@pytest.mark.parametrize("layout,fsdp", [(l, f) for _, l, f in LAYOUTS], ids=[n for n, _, _ in LAYOUTS])
def test_glm_import_under_layout_matches_one_process_and_exports_bit_identically(tmp_path, layout, fsdp):
    hf_dir = tmp_path / "hf"
    make_glm_model(hf_dir, tokenizer=False, num_hidden_layers=4)
    merged, original = import_export_under_layout(hf_dir, layout, fsdp, tmp_path / "saved")
    assert any(name.endswith("e_score_correction_bias") for name in merged)
    for name, tensor in merged.items():
        assert tensor.dtype == original[name].dtype and torch.equal(tensor, original[name]), name
    saved = _original(tmp_path / "saved")
    assert sorted(saved) == sorted(original) and all(torch.equal(saved[k], v) for k, v in original.items())


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


@pytest.mark.slow
def test_glm_pretrain_ep2_matches_one_process(tmp_path):
    hf_dir = tmp_path / "hf"
    make_glm_model(hf_dir, tokenizer=False, vocab_size=256)
    reference_dir, ep2_dir = tmp_path / "one", tmp_path / "ep2"
    _glm_pretrain_task(str(reference_dir), str(hf_dir))
    get_shared_pool(2).run(_glm_pretrain_task, str(ep2_dir), str(hf_dir), 2, timeout=300)
    ref, got = train_records(str(reference_dir)), train_records(str(ep2_dir))
    assert [r["iteration"] for r in got] == list(range(1, ITERS + 1)) == [r["iteration"] for r in ref]
    for key in ("lm loss",):
        for r, w in zip(got, ref):
            assert math.isclose(r["losses"][key], w["losses"][key], rel_tol=REL_TOL), (r["iteration"], key)
    for r, w in zip(got, ref):
        assert math.isclose(r["grad_norm"], w["grad_norm"], rel_tol=REL_TOL), r["iteration"]
    assert ref[-1]["losses"]["lm loss"] < ref[0]["losses"]["lm loss"]
