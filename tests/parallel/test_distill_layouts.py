"""Distillation (``longspan.training.distill``) under TP2, PP2, CP2 and DP2 with FSDP2 trains as one process does.

One tiny HF teacher and one tiny student of the same width (``tests/helpers/distill.py``), both laid out by the
student's plan: 8 iterations of ``distill`` with the LM loss, the KL and the final norms' cosine loss
(``skip_lm_loss=False``, ``kd_loss_scale=0.5``: every component and ModelOpt's balance are in the loss); every
iteration's LM loss, KL, intermediate loss, total loss and gradient norm within 1e-5 (relative) of one process's.
TP2 checks the vocab-parallel KL (each rank's vocabulary rows of both output layers), PP2 the teacher's hidden
states handed from stage to stage beside the student's, CP2 both models on the same sequence chunks, FSDP2 the
teacher's sharded layers and its gathered output layer.
"""

from __future__ import annotations

import pytest

from tests.helpers.distill import KEYS, distill_config, logged, write_teacher
from tests.parallel.harness import get_shared_pool

ITERS = 8
REL = 1e-5
LAYOUTS = {"tp2": dict(tp=2), "pp2": dict(pp=2), "cp2": dict(cp=2), "dp2_fsdp2": dict(fsdp2=True)}


def _distill(run_dir: str, teacher: str, **layout) -> int:
    from longspan.training.distill import distill

    cfg = distill_config(run_dir, teacher, ITERS, hidden=48, skip_lm_loss=False, kd_loss_scale=0.5,
                         intermediate_layer_pairs=[["decoder.final_layernorm", "decoder.final_layernorm"]], **layout)
    return distill(cfg).train_state.step


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_teacher(str(tmp_path_factory.mktemp("teacher")))


@pytest.fixture(scope="module")
def one_process(teacher_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    run_dir = str(tmp_path_factory.mktemp("one"))
    assert _distill(run_dir, teacher_dir) == ITERS
    return logged(run_dir)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_distillation_under_layout_matches_one_process(name: str, teacher_dir: str, one_process: dict,
                                                       tmp_path) -> None:
    want = one_process
    assert want["logits distillation loss"][-1] < want["logits distillation loss"][0]  # the reference learned
    get_shared_pool(2).run(_distill, str(tmp_path), teacher_dir, timeout=240, **LAYOUTS[name])
    got = logged(str(tmp_path))
    assert got["iterations"] == want["iterations"] == list(range(1, ITERS + 1))
    assert set(got) == set(want) == {*KEYS, "grad norm", "iterations"}
    for key in (*KEYS, "grad norm"):
        for i, (g, w) in enumerate(zip(got[key], want[key], strict=True)):
            assert abs(g - w) <= REL * abs(w), f"{name} {key}[{i}]: {g} vs one process {w}"
