"""The planner's step time charges routed experts by ``model.moe_grouped_gemm`` (``longspan.planner.expert_time``):
one grouped GEMM per projection, or the expert-by-expert loop's cost per local expert, on the MoE layers only,
per microbatch, divided by expert parallel."""

from __future__ import annotations

import pytest
import torch

from longspan.config.schema.optim import apply_mixed_precision, bf16_mixed
from longspan.planner import expert_time
from longspan.planner import plan as planner
from longspan.recipes import get_recipe

EXPERTS, MICROBATCHES = 64, 2


def _cfg(grouped: bool):
    cfg = get_recipe("tiny-moe")
    apply_mixed_precision(bf16_mixed(), cfg.model, cfg.optimizer, cfg.ddp)  # the GPU grouped kernel's dtype
    m = cfg.model
    m.num_moe_experts, m.moe_grouped_gemm = EXPERTS, grouped
    m.num_layers, m.moe_layer_freq = 2, [1, 0]  # one MoE layer of two: the dense layer adds nothing
    cfg.train.global_batch_size = MICROBATCHES * cfg.train.micro_batch_size * 2  # 2 microbatches at dp 2
    m.finalize()
    return cfg


@pytest.fixture(scope="module")
def layouts() -> dict[int, tuple]:
    """Expert-parallel size -> (grouped config, sequential config, layout) on two ranks (dp 2)."""
    out = {}
    for grouped in (True, False):
        for lcfg, layout in planner.candidate_layouts(_cfg(grouped), 2)[0]:
            if layout.tp == layout.pp == layout.cp == 1:
                out.setdefault(layout.ep, {})[grouped] = (lcfg, layout)
    return out


@pytest.mark.parametrize("ep", [1, 2])
def test_sequential_experts_cost_the_loop_per_local_expert(layouts, ep):
    (grouped_cfg, layout), (seq_cfg, _) = layouts[ep][True], layouts[ep][False]
    assert layout.dp == 2 and layout.ep == ep
    grouped = planner.estimate_step_time(grouped_cfg, layout, "h100")
    sequential = planner.estimate_step_time(seq_cfg, layout, "h100")
    local = EXPERTS // ep
    # one MoE layer x 2 microbatches: the loop's cost per local expert against 3 kernels per SwiGLU projection
    expected = MICROBATCHES * (local * expert_time.SEQUENTIAL_EXPERT_S - 9 * expert_time.KERNEL_LAUNCH_S)
    assert sequential - grouped == pytest.approx(expected, rel=1e-9)
    assert grouped_cfg.model.moe_grouped_gemm and not seq_cfg.model.moe_grouped_gemm


def test_grouped_cost_per_device_and_activation():
    m = _cfg(True).model
    launches = 9 * expert_time.KERNEL_LAUNCH_S
    assert expert_time.expert_overhead_per_layer_s(m, "h100", 1) == pytest.approx(launches)
    # the CPU's grouped kernel loops over the experts itself
    cpu = launches + EXPERTS * expert_time.GROUPED_EXPERT_S["cpu"]
    assert expert_time.expert_overhead_per_layer_s(m, "cpu", 1) == pytest.approx(cpu)
    m.gated_linear_unit = False  # two projections: 6 kernels
    assert expert_time.expert_overhead_per_layer_s(m, "h100", 1) == pytest.approx(6 * expert_time.KERNEL_LAUNCH_S)
    # where the grouped kernel cannot serve, the model runs the loop and the estimate charges it
    loop = EXPERTS * expert_time.SEQUENTIAL_EXPERT_S
    m.params_dtype = torch.float32  # the CUDA kernel takes bfloat16 only; the CPU's takes float32
    assert expert_time.expert_overhead_per_layer_s(m, "h100", 1) == pytest.approx(loop)
    assert expert_time.expert_overhead_per_layer_s(m, "cpu", 1) < loop
    m.params_dtype, m.moe_ffn_hidden_size = torch.bfloat16, 100  # 200-byte rows: not a multiple of 16
    assert expert_time.expert_overhead_per_layer_s(m, "h100", 1) == pytest.approx(loop)


def test_pipeline_stages_count_their_own_moe_layers():
    cfg = _cfg(False)
    per_layer = expert_time.expert_overhead_per_layer_s(cfg.model, "h100", 1)
    one_stage = expert_time.expert_overhead_s(cfg, "h100", 1, MICROBATCHES, {0: 0, 1: 0})
    assert one_stage == pytest.approx(MICROBATCHES * per_layer)
    cfg.model.moe_layer_freq = 1  # both layers MoE: two per rank on one stage, one per rank on two stages
    assert expert_time.expert_overhead_s(cfg, "h100", 1, 1, {0: 0, 1: 0}) == pytest.approx(2 * per_layer)
    assert expert_time.expert_overhead_s(cfg, "h100", 1, 1, {0: 0, 1: 1}) == pytest.approx(per_layer)
