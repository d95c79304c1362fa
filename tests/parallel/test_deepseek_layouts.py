"""DeepSeek-V3 with MoE layers (a tiny random HF directory: multi-latent attention with query compression, a dense
first layer, group-limited sigmoid routing with non-zero routing biases, a shared expert) under expert parallel:

- imported under EP2 + FSDP2 it gives one process's logits and its export (routing biases included) is
  bit-identical to the source;
- trained by ``pretrain`` under EP2 on 2 ranks (dropout off; the routing biases move every step) it gives one
  process's per-iteration losses and grad norms (relative 1e-5 over 8 iterations);
- the ``tiny-deepseek`` recipe from random weights under EP2, TP2 and PP2 gives one process's losses and grad norms
  (relative 1e-5 over 8 iterations).
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.conversion.test_deepseek_moe import save_random_deepseek_moe
from tests.helpers.layout_parity import import_export_under_layout, train_records
from tests.parallel.harness import get_shared_pool
from tests.parallel.test_glm_layouts import _glm_pretrain_task
from tests.training.pretrain_helpers import mock_layout_run

ITERS = 8
REL_TOL = 1e-5


def test_deepseek_moe_import_under_ep2_fsdp2_matches_one_process_and_exports_bit_identically(tmp_path):
    hf_dir = tmp_path / "hf"
    save_random_deepseek_moe(hf_dir, 24, num_hidden_layers=4)
    merged, original = import_export_under_layout(hf_dir, {"expert_model_parallel_size": 2}, True,
                                                  tmp_path / "saved")
    assert any(name.endswith("e_score_correction_bias") for name in merged)
    assert any(name.endswith("kv_a_proj_with_mqa.weight") for name in merged)
    for name, tensor in merged.items():
        assert tensor.dtype == original[name].dtype and torch.equal(tensor, original[name]), name


@pytest.mark.slow
def test_deepseek_moe_pretrain_ep2_matches_one_process(tmp_path):
    hf_dir = tmp_path / "hf"
    save_random_deepseek_moe(hf_dir, 24, vocab_size=256)
    reference_dir, ep2_dir = tmp_path / "one", tmp_path / "ep2"
    _glm_pretrain_task(str(reference_dir), str(hf_dir))  # mock data, EP layout; the architecture is config.json's
    get_shared_pool(2).run(_glm_pretrain_task, str(ep2_dir), str(hf_dir), 2, timeout=300)
    ref, got = train_records(str(reference_dir)), train_records(str(ep2_dir))
    assert [r["iteration"] for r in got] == list(range(1, ITERS + 1)) == [r["iteration"] for r in ref]
    for r, w in zip(got, ref):
        assert math.isclose(r["losses"]["lm loss"], w["losses"]["lm loss"], rel_tol=REL_TOL), r["iteration"]
        assert math.isclose(r["grad_norm"], w["grad_norm"], rel_tol=REL_TOL), r["iteration"]
    assert ref[-1]["losses"]["lm loss"] < ref[0]["losses"]["lm loss"]


def _recipe_config(run_dir: str, ep: int = 1, tp: int = 1, pp: int = 1):
    """``tiny-deepseek`` from random weights (MLA with query compression, a dense first layer, 8 routed + 1 shared
    expert, expert bias) shrunk to seconds: mock data, 64-token sequences, dropout off."""
    from longspan.recipes import get_recipe

    cfg = get_recipe("tiny-deepseek")
    m = cfg.model
    m.hidden_size, m.ffn_hidden_size, m.moe_ffn_hidden_size, m.moe_shared_expert_intermediate_size = 64, 128, 32, 32
    m.num_attention_heads, m.seq_length, m.vocab_size = 4, 64, None
    m.expert_model_parallel_size, m.tensor_model_parallel_size, m.pipeline_model_parallel_size = ep, tp, pp
    return mock_layout_run(cfg, run_dir, 64, 2, 8, ITERS)


def _recipe_pretrain(run_dir: str, ep: int = 1, tp: int = 1, pp: int = 1) -> None:
    from longspan.training.pretrain import pretrain

    pretrain(_recipe_config(run_dir, ep, tp, pp))


RECIPE_LAYOUTS = {"ep2": (2, 1, 1), "tp2": (1, 2, 1), "pp2": (1, 1, 2)}


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(RECIPE_LAYOUTS))
def test_tiny_deepseek_from_random_weights_under_layout_matches_one_process(tmp_path, layout):
    """Random initialization, MLA and the MoE layers (with the per-step routing-bias update from the DP-summed
    token counts) give one process's losses and grad norms under EP2, TP2 and PP2 (the dense and one MoE
    layer on the first stage, two MoE layers on the second)."""
    _recipe_pretrain(str(tmp_path / "one"))
    get_shared_pool(2).run(_recipe_pretrain, str(tmp_path / layout), *RECIPE_LAYOUTS[layout], timeout=300)
    ref, got = train_records(str(tmp_path / "one")), train_records(str(tmp_path / layout))
    assert [r["iteration"] for r in got] == list(range(1, ITERS + 1)) == [r["iteration"] for r in ref]
    for r, w in zip(got, ref):
        assert math.isclose(r["losses"]["lm loss"], w["losses"]["lm loss"], rel_tol=REL_TOL), r["iteration"]
        assert math.isclose(r["grad_norm"], w["grad_norm"], rel_tol=REL_TOL), r["iteration"]
    assert ref[-1]["losses"]["lm loss"] < ref[0]["losses"]["lm loss"]
