"""Grouped expert GEMMs (``moe_grouped_gemm``) against the sequential reference, the device-side permutation,
the log line where the grouped kernel cannot serve, and compile tracing the MoE layer whole without recompiles."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from longspan.models import moe as moe_mod
from longspan.models.activations import quick_gelu, squared_relu
from longspan.models.gpt import build_gpt_model
from longspan.models.grouped_gemm import grouped_gemm_unsupported, grouped_linear
from longspan.models.moe import MoELayer
from longspan.models.moe_router import set_aux_loss_scale
from longspan.models.moe_dispatch import permute

from tests.models.test_moe import provider

ACTIVATIONS = {
    "swiglu": {},
    # GPT-OSS's experts: clamped SwiGLU (quick-GELU gate, +1 on the up projection) with biases everywhere
    "clamped_swiglu_bias": dict(add_bias_linear=True, activation_func=quick_gelu, glu_linear_offset=1.0,
                                activation_func_clamp_value=7.0),
    "squared_relu": dict(gated_linear_unit=False, activation_func=squared_relu),
}
ROUTING = {
    "plain": {},
    "expert_bias_z_loss": dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                               moe_z_loss_coeff=1e-3),
    "capacity_drop": dict(moe_expert_capacity_factor=0.75),
    "capacity_pad_position": dict(moe_expert_capacity_factor=0.75, moe_pad_expert_input_to_capacity=True,
                                  moe_token_drop_policy="position"),
    "group_limited": dict(num_moe_experts=8, moe_router_topk=4, moe_router_num_groups=4, moe_router_group_topk=2),
}


@pytest.fixture(autouse=True)
def _unit_aux_scale():
    set_aux_loss_scale(1.0)
    yield
    set_aux_loss_scale(1.0)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def _step(grouped: bool, overrides: dict, steps: int = 2) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Losses of ``steps`` forward/backward passes of a 2-layer MoE model, and the gradients summed over them."""
    model = build_gpt_model(provider(moe_grouped_gemm=grouped, **overrides), seed=0).train()
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    assert all(layer.experts.grouped_gemm is grouped for layer in layers)
    losses = []
    for step in range(steps):
        ids = torch.randint(0, 128, (3, 8), generator=torch.Generator().manual_seed(step))
        loss = model(ids, labels=ids).mean()
        loss.backward()
        losses.append(loss.detach())
    return losses, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("routing", sorted(ROUTING))
@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
def test_grouped_matches_sequential(activation, routing):
    """Same losses and gradients (relative 1e-6, float32) with the grouped kernel and the expert loop."""
    overrides = {**ACTIVATIONS[activation], **ROUTING[routing]}
    calls = []
    real = moe_mod.grouped_linear

    def counted(*args):
        calls.append(1)
        return real(*args)

    moe_mod.grouped_linear = counted
    try:
        losses_g, grads_g = _step(True, overrides)
    finally:
        moe_mod.grouped_linear = real
    gated = 3 if "gated_linear_unit" not in overrides else 2
    assert len(calls) == 2 * 2 * gated  # steps × layers × projections: the grouped path ran, no fallback
    losses_s, grads_s = _step(False, overrides)
    for a, b in zip(losses_g, losses_s):
        assert _rel(a, b) <= 1e-6
    assert grads_g.keys() == grads_s.keys()
    for name in grads_s:
        assert _rel(grads_g[name], grads_s[name]) <= 1e-6, name


def test_grouped_linear_matches_per_expert_products_with_padding_rows():
    """Forward and both gradients of one grouped product equal the per-expert ``F.linear`` loop; empty experts
    and padding rows past the last offset (zeros out, no gradient) included."""
    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([3, 0, 5, 2])
    x = torch.randn(12, 16, generator=g, requires_grad=True)
    w = torch.randn(4, 8, 16, generator=g, requires_grad=True)
    y = grouped_linear(x, w, torch.cumsum(counts, 0).to(torch.int32))
    y.sum().backward()  # a stride-0 output gradient
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    want = torch.cat([F.linear(rows, w[e]) for e, rows in enumerate(torch.split(x[:10], counts.tolist()))])
    want = torch.cat([want, want.new_zeros(2, 8)])
    want.sum().backward()
    assert torch.equal(y, want)
    torch.testing.assert_close(gx, x.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gw, w.grad, rtol=1e-6, atol=1e-6)
    assert torch.equal(gx[10:], torch.zeros(2, 16))


@pytest.mark.parametrize("routing", ["plain", "capacity_drop", "capacity_pad_position"])
def test_device_permutation_matches_host_count(routing):
    """The static row count from the router equals (or bounds) the routing map's, and the permutation's routed
    rows are the host-counted permutation's."""
    layer = build_gpt_model(provider(**ROUTING[routing]), seed=0).decoder.layers["0"].mlp.train()
    x = torch.randn(24, 32, generator=torch.Generator().manual_seed(1))
    _, routing_map = layer.router(x)
    count, exact = layer.router.routed_rows(24)
    routed = int(routing_map.sum())
    assert count == routed if exact else count >= routed
    rows, perm = permute(x, routing_map, (count, exact))
    want_rows, want = permute(x, routing_map)
    assert rows.shape[0] == count
    assert torch.equal(rows[:routed], want_rows) and torch.equal(perm.token_index[:routed], want.token_index)
    assert torch.equal(perm.tokens_per_expert, want.tokens_per_expert)
    if not exact:
        assert not perm.valid[routed:].any() and perm.valid[:routed].all()


def test_fallback_is_logged_once_and_runs_sequentially(caplog):
    """float64 has no grouped kernel: the layer says so (once) and runs the expert loop."""
    moe_mod._WARNED.clear()
    layer = build_gpt_model(provider(moe_grouped_gemm=True), seed=0).decoder.layers["0"].mlp.double().train()
    x = torch.randn(2, 8, 32, dtype=torch.float64)
    with caplog.at_level(logging.WARNING, logger="longspan"):
        layer(x)
        layer(x)
    lines = [r.getMessage() for r in caplog.records if "moe_grouped_gemm" in r.getMessage()]
    assert len(lines) == 1 and "sequential path" in lines[0] and "torch.float64" in lines[0]
    assert not layer.experts.uses_grouped_gemm(x) and layer.experts.uses_grouped_gemm(x.float())


def test_unsupported_reasons():
    cpu = torch.device("cpu")
    assert grouped_gemm_unsupported(torch.float32, cpu, (256, 128)) is None
    assert grouped_gemm_unsupported(torch.bfloat16, cpu, (256, 64)) is None
    assert "float64" in grouped_gemm_unsupported(torch.float64, cpu, (256, 128))
    assert "16 bytes" in grouped_gemm_unsupported(torch.float32, cpu, (256, 6))


@pytest.mark.parametrize("overrides", [{}, ACTIVATIONS["clamped_swiglu_bias"], ROUTING["capacity_drop"]])
def test_compile_traces_moe_layer_whole_without_recompiles(overrides):
    """One graph for the grouped MoE layer (router, aux and z losses, permutation, experts, metrics) over four
    training steps with different routing: nothing is read on the host, nothing recompiles."""
    torch._dynamo.reset()
    layer = build_gpt_model(provider(moe_grouped_gemm=True, moe_z_loss_coeff=1e-3, **overrides),
                            seed=0).decoder.layers["0"].mlp.train()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    compiled = torch.compile(layer, backend=backend, fullgraph=True)
    eager = build_gpt_model(provider(moe_grouped_gemm=True, moe_z_loss_coeff=1e-3, **overrides),
                            seed=0).decoder.layers["0"].mlp.train()
    for step in range(4):
        x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(step))
        out = compiled(x)
        want = eager(x)
        (out * out).sum().backward()
        (want * want).sum().backward()
        torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-7)
    assert len(graphs) == 1
    assert float(layer.metric_steps) == 4
    for name, p in layer.named_parameters():
        torch.testing.assert_close(p.grad, eager.get_parameter(name).grad, rtol=1e-5, atol=1e-7)
