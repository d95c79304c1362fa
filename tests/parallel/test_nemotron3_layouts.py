"""Nemotron 3's MoE hybrid (Mamba-2, attention, MLP and MoE layers in one pattern) under every layout trains
the same model as one process.

One tiny model, shared: ``tiny-hybrid`` cut to 6 layers ``ME*-EM`` (the pipeline cut falls between the attention
and the MLP layer), hidden 48, 4 Mamba heads of 12 in 2 groups, attention 4 heads / 2 groups; its MoE layers
are Nemotron 3's: 4 squared-ReLU experts of width 32 in a latent space of 16 (``moe_latent_size``), top 2 of the
best 1 of 2 expert groups by sigmoid scores with the aux-loss-free expert bias (moving every step), scaled by
2.5, a shared expert of width 24, grouped expert GEMMs and a load-balancing loss (so context parallel's whole-
sequence token counts matter).

``pretrain`` for 8 iterations under TP2 with sequence parallel (the Mamba mixers, attention, MLP, shared expert,
experts' width and latent projections split), PP2, EP2, CP2 (the Mamba all-to-all to heads, the routers' whole-
sequence counts) and DP2 with FSDP2: every iteration's loss and gradient norm within 1e-5 (relative) of one
process's.
"""

from __future__ import annotations

import os

import pytest

from tests.helpers.layout_parity import logged
from tests.parallel.harness import get_shared_pool
from tests.training.pretrain_helpers import mock_layout_run

ITERS = 8
REL = 1e-5
SEQ = 64

MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=24,
           moe_latent_size=16, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
           moe_router_bias_update_rate=1e-2, moe_router_num_groups=2, moe_router_group_topk=1,
           moe_router_topk_scaling_factor=2.5, moe_router_dtype="fp32", moe_router_load_balancing_type="aux_loss",
           moe_aux_loss_coeff=1e-2, moe_grouped_gemm=True)


def _config(run_dir: str, tp: int = 1, sp: bool = False, pp: int = 1, cp: int = 1, ep: int = 1,
            fsdp2: bool = False):
    from longspan.recipes import get_recipe

    cfg = get_recipe("tiny-hybrid")
    m = cfg.model
    m.num_layers, m.hybrid_override_pattern, m.hidden_size, m.ffn_hidden_size = 6, "ME*-EM", 48, 64
    m.mamba_num_heads, m.mamba_head_dim, m.mamba_num_groups, m.mamba_state_dim = 4, 12, 2, 8
    m.mamba_chunk_size = 16
    m.num_attention_heads, m.num_query_groups = 4, 2
    for name, value in MOE.items():
        setattr(m, name, value)
    m.tensor_model_parallel_size, m.sequence_parallel = tp, sp
    m.pipeline_model_parallel_size, m.context_parallel_size, m.expert_model_parallel_size = pp, cp, ep
    cfg.dist.use_torch_fsdp2 = fsdp2
    return mock_layout_run(cfg, f"{run_dir}/tb", SEQ, 2, 8, ITERS)


def _pretrain(run_dir: str, **layout) -> int:
    from longspan.training.pretrain import pretrain

    return pretrain(_config(run_dir, **layout)).train_state.step


LAYOUTS = {  # name: the config builder's keyword arguments (2 processes each)
    "tp2_sp": dict(tp=2, sp=True),
    "pp2": dict(pp=2),
    "ep2": dict(ep=2),
    "cp2": dict(cp=2),
    "dp2_fsdp2": dict(fsdp2=True),
}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The one-process run, trained once for the module."""
    run_dir = str(tmp_path_factory.mktemp("one_process"))
    assert _pretrain(run_dir) == ITERS
    return logged(os.path.join(run_dir, "tb"))


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_one_process(name: str, one_process: dict, tmp_path) -> None:
    want = one_process
    assert want["losses"][-1] < want["losses"][0] * 0.95  # the reference trained
    get_shared_pool(2).run(_pretrain, str(tmp_path), timeout=200, **LAYOUTS[name])
    got = logged(os.path.join(str(tmp_path), "tb"))
    assert got["iterations"] == want["iterations"] == list(range(1, ITERS + 1))
    for key in ("losses", "norms"):
        for i, (g, w) in enumerate(zip(got[key], want[key], strict=True)):
            assert abs(g - w) <= REL * abs(w), f"{name} {key}[{i}]: {g} vs one process {w}"
