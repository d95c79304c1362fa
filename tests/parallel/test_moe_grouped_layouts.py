"""Grouped expert GEMMs under expert parallel layouts: on each layout (EP2, ETP2, EP2 × TP2) ``moe_grouped_gemm``
trains the same model as the sequential expert loop (losses and gradient norms within 1e-6 relative, float32),
with the GPT-OSS expert form (clamped SwiGLU, biases) and token dropping where the layout allows it; and a
grouped run stopped and resumed through the trainer gives the straight run's losses bit for bit."""

from __future__ import annotations

import math

import pytest

from tests.parallel.harness import get_shared_pool
from tests.parallel.test_moe_parity import moe_config, train_moe_layout

REL = 1e-6
ITERS = 2


def _grouped_and_sequential(ep: int, tp: int, capacity: float | None = None, biases: bool = False) -> dict:
    """On this rank's layout: the sequential run, then the grouped run (counting its grouped products)."""
    import longspan.models.moe as moe_mod
    from longspan.models.activations import quick_gelu

    out = {}
    real = moe_mod.grouped_linear
    for grouped in (False, True):
        cfg = moe_config(ep=ep, tp=tp, capacity=capacity)
        cfg.model.moe_grouped_gemm = grouped
        if biases:  # GPT-OSS's experts
            cfg.model.add_bias_linear = True
            cfg.model.activation_func = quick_gelu
            cfg.model.glu_linear_offset = 1.0
            cfg.model.activation_func_clamp_value = 7.0
        calls = []

        def counted(*args):
            calls.append(1)
            return real(*args)

        moe_mod.grouped_linear = counted
        try:
            out[grouped] = train_moe_layout(cfg, iters=ITERS)
        finally:
            moe_mod.grouped_linear = real
        out[grouped]["grouped_calls"] = len(calls)
    return out


def _check(results: list[dict], what: str) -> None:
    for r in results:
        assert r[False]["grouped_calls"] == 0 and r[True]["grouped_calls"] > 0, what  # no silent fallback
        for key in ("losses", "norms"):
            for got, want in zip(r[True][key], r[False][key]):
                assert math.isclose(got, want, rel_tol=REL), f"{what} {key}: grouped {got} vs sequential {want}"


@pytest.mark.slow
def test_grouped_matches_sequential_ep2_with_capacity():
    _check(get_shared_pool(2).run(_grouped_and_sequential, 2, 1, 1.0, timeout=300), "EP2 capacity 1.0")


@pytest.mark.slow
def test_grouped_matches_sequential_etp2_with_biases():
    _check(get_shared_pool(2).run(_grouped_and_sequential, 1, 2, None, True, timeout=300), "ETP2 biases")


@pytest.mark.slow
def test_grouped_matches_sequential_ep2_tp2_with_biases():
    _check(get_shared_pool(4).run(_grouped_and_sequential, 2, 2, None, True, timeout=300), "EP2xTP2 biases")


@pytest.mark.slow
def test_grouped_stop_and_resume_is_bit_exact(tmp_path):
    """``pretrain`` with grouped experts and expert bias, stopped after 3 of 6 iterations and resumed."""
    from longspan.training.pretrain import pretrain
    from tests.parallel.test_moe_bias import RESUME_ITERS, _losses, _pretrain_config

    def config(name, exit_interval=None):
        cfg = _pretrain_config(tmp_path, name, exit_interval=exit_interval)
        cfg.model.moe_grouped_gemm = True
        return cfg

    straight = config("straight")
    pretrain(straight)
    reference = _losses(straight)
    pretrain(config("resumed", exit_interval=3))
    resumed_cfg = config("resumed")
    pretrain(resumed_cfg)
    resumed = _losses(resumed_cfg)
    assert [resumed[i] for i in range(1, RESUME_ITERS + 1)] == [reference[i] for i in range(1, RESUME_ITERS + 1)]
