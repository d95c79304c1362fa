"""GPT-OSS's model features under expert parallel 2, tensor parallel 2 and both (4 ranks) train the same
model as one process: learned attention sinks (split by heads under TP), q/k/v/o, router and expert biases, the
clamped SwiGLU with its +1 offset (a clamp that bites), alternating sliding/full layers. Losses and gradient
norms over 8 iterations within 1e-5 relative (fp32, dropout off), model + optimizer level as
``test_moe_parity``."""

from __future__ import annotations

import math

import pytest

from tests.parallel.harness import get_shared_pool
from tests.parallel.test_moe_parity import moe_config, train_moe_layout

ITERS = 8
REL_TOL = 1e-5


def gpt_oss_config(ep: int = 1, tp: int = 1):
    from longspan.models.activations import quick_gelu

    cfg = moe_config(ep=ep, tp=tp)
    m = cfg.model
    m.softmax_type = "learnable"
    m.activation_func = quick_gelu
    m.gated_linear_unit = True
    m.glu_linear_offset = 1.0
    m.activation_func_clamp_value = 0.05
    m.add_bias_linear = True
    m.add_qkv_bias = True
    m.window_size = [3, 0]
    m.window_attn_skip_freq = 2
    m.moe_router_load_balancing_type = "none"
    m.moe_aux_loss_coeff = 0.0
    m.moe_z_loss_coeff = None
    m.hidden_dropout = 0.0
    m.attention_dropout = 0.0
    return cfg


def _layout_task(ep: int, tp: int) -> dict:
    return train_moe_layout(gpt_oss_config(ep=ep, tp=tp), iters=ITERS)


_REFERENCE: dict = {}


def _reference() -> dict:
    if "ref" not in _REFERENCE:
        _REFERENCE["ref"] = _layout_task(1, 1)
    return _REFERENCE["ref"]


def _assert_close(got: list[float], want: list[float], what: str) -> None:
    assert len(got) == len(want) == ITERS, (what, got, want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert math.isclose(g, w, rel_tol=REL_TOL), f"{what} iteration {i + 1}: {g} vs one process {w}"


@pytest.mark.slow
@pytest.mark.parametrize("ep, tp", [(2, 1), (1, 2)], ids=["ep2", "tp2"])
def test_layout_matches_one_process(ep, tp):
    ref = _reference()
    assert ref["losses"][-1] < ref["losses"][0] - 0.05  # the model trained
    for r in get_shared_pool(2).run(_layout_task, ep, tp, timeout=400):
        _assert_close(r["losses"], ref["losses"], f"EP{ep} TP{tp} loss")
        _assert_close(r["norms"], ref["norms"], f"EP{ep} TP{tp} grad norm")


@pytest.mark.slow
def test_ep2_tp2_matches_one_process():
    """EP2 × TP2 on 4 ranks: 2 experts per rank, each half its ffn width (gate/up biases split with it)."""
    ref = _reference()
    for r in get_shared_pool(4).run(_layout_task, 2, 2, timeout=500):
        assert r["local_expert_shape"] == (2, 16, 64)
        _assert_close(r["losses"], ref["losses"], "EP2xTP2 loss")
        _assert_close(r["norms"], ref["norms"], "EP2xTP2 grad norm")
