"""MoE layer tests: routing, dropping and aux losses against megatron-core's functions (the oracle), the layer
against a naive per-token reference, layer placement, init, config errors, freezing and metrics."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from longspan.core.errors import ConfigError, NotSupportedError
from longspan.models.gpt import build_gpt_model, resolve_model_args
from longspan.models.gpt_provider import GPTModelProvider
from longspan.models.moe import MoELayer, moe_layer_metrics, reset_moe_metrics
from longspan.models.moe_router import drop_tokens, set_aux_loss_scale

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.transformer.moe import moe_utils as mcore


def provider(**overrides) -> GPTModelProvider:
    kwargs = dict(
        num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, seq_length=8, vocab_size=128,
        make_vocab_size_divisible_by=128, normalization="RMSNorm", position_embedding_type="rope",
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, init_method_std=0.02, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16,
        moe_aux_loss_coeff=1e-2,
    )
    kwargs.update(overrides)
    return GPTModelProvider(**kwargs)


def moe_layer(seed: int = 0, **overrides) -> MoELayer:
    model = build_gpt_model(provider(**overrides), seed=seed)
    return model.decoder.layers["0"].mlp


@pytest.fixture(autouse=True)
def _unit_aux_scale():
    set_aux_loss_scale(1.0)
    yield
    set_aux_loss_scale(1.0)


# ------------------------------------------------------------------------------------------- routing vs mcore

@pytest.mark.parametrize(
    "overrides, mcore_kwargs",
    [
        ({}, {}),
        ({"moe_router_pre_softmax": True}, {"use_pre_softmax": True}),
        ({"moe_router_score_function": "sigmoid"}, {"score_function": "sigmoid"}),
        ({"moe_router_topk_scaling_factor": 2.5}, {"scaling_factor": 2.5}),
        ({"num_moe_experts": 8, "moe_router_topk": 4, "moe_router_num_groups": 4, "moe_router_group_topk": 2},
         {"num_groups": 4, "group_topk": 2}),
    ],
)
def test_routing_matches_megatron(overrides, mcore_kwargs):
    layer = moe_layer(**overrides).eval()
    logits = torch.randn(40, layer.num_experts, generator=torch.Generator().manual_seed(3))
    probs, routing_map, _ = layer.router.routing(logits)
    want_probs, want_map = mcore.topk_routing_with_score_function(logits, layer.router.moe.topk, **mcore_kwargs)
    assert torch.equal(routing_map, want_map)
    torch.testing.assert_close(probs, want_probs, rtol=1e-6, atol=1e-7)


def test_capacity_dropping_probs_policy_matches_megatron():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(24, 4, generator=g)
    probs, routing_map = mcore.topk_routing_with_score_function(logits, 2)
    for factor, pad in ((1.0, False), (0.5, False), (0.75, True)):
        got_p, got_m = drop_tokens(probs, routing_map, 2, factor, "probs", pad)
        want_p, want_m = mcore.apply_router_token_dropping(probs, routing_map, 2, factor, "probs", pad)
        assert torch.equal(got_m, want_m), factor
        torch.testing.assert_close(got_p, want_p)
    capacity = math.ceil(24 * 2 / 4 * 0.5)
    assert int(drop_tokens(probs, routing_map, 2, 0.5, "probs", False)[1].sum(0).max()) <= capacity


def test_capacity_dropping_position_policy_keeps_earliest_tokens():
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(20, 4, generator=g)
    probs, routing_map = mcore.topk_routing_with_score_function(logits, 2)
    capacity = math.ceil(20 * 2 / 4 * 0.5)
    _, got = drop_tokens(probs, routing_map, 2, 0.5, "position", False)
    want = torch.zeros_like(routing_map)
    for e in range(4):  # naive: walk the tokens in order, keep until the expert is full
        kept = 0
        for t in range(20):
            if routing_map[t, e] and kept < capacity:
                want[t, e] = True
                kept += 1
    assert torch.equal(got, want)


# ------------------------------------------------------------------------------------------- aux losses

def test_aux_and_z_loss_values_match_megatron():
    layer = moe_layer(moe_z_loss_coeff=1e-3).train()
    x = torch.randn(30, 32, generator=torch.Generator().manual_seed(1))
    logits = layer.router.gating(x).detach()
    _, _, tracked = layer.router.routing(logits.clone().requires_grad_(True))
    routing_map, scores = mcore.compute_routing_scores_for_aux_loss(logits, 2, "softmax")
    want_aux = mcore.switch_load_balancing_loss_func(scores, routing_map.sum(0), 30, 2, 4, 1e-2)
    want_z = mcore.z_loss_func(logits, 1e-3)
    torch.testing.assert_close(tracked["load_balancing_loss"], want_aux / 1e-2)
    torch.testing.assert_close(tracked["z_loss"], want_z / 1e-3)


def _router_grad(layer: MoELayer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    layer.zero_grad()
    out = layer(x.unsqueeze(0))
    out.square().sum().backward()
    return out.detach(), layer.router.weight.grad.clone()


def test_aux_loss_joins_the_gradient_not_the_output():
    """The output is the same with and without the aux loss; the router gradient gains scale * d(aux)/dW."""
    x = torch.randn(24, 32, generator=torch.Generator().manual_seed(2))
    with_aux = moe_layer(seed=4, moe_aux_loss_coeff=1e-1, moe_z_loss_coeff=1e-2).train()
    without = moe_layer(seed=4, moe_aux_loss_coeff=0.0).train()
    out_a, grad_a = _router_grad(with_aux, x)
    out_b, grad_b = _router_grad(without, x)
    torch.testing.assert_close(out_a, out_b)
    # Oracle: the aux and z losses written out with megatron-core's functions, differentiated by autograd.
    weight = without.router.weight.detach().clone().requires_grad_(True)
    logits = x @ weight.t()
    routing_map, scores = mcore.compute_routing_scores_for_aux_loss(logits, 2, "softmax")
    aux = mcore.switch_load_balancing_loss_func(scores, routing_map.sum(0), 24, 2, 4, 1e-1)
    (aux + mcore.z_loss_func(logits, 1e-2)).backward()
    torch.testing.assert_close(grad_a - grad_b, weight.grad, rtol=1e-4, atol=1e-8)
    set_aux_loss_scale(0.25)
    _, grad_quarter = _router_grad(with_aux, x)
    torch.testing.assert_close(grad_quarter - grad_b, 0.25 * weight.grad, rtol=1e-4, atol=1e-8)


# ------------------------------------------------------------------------------------------- the layer

def _naive_layer(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """Per-token reference: sum over the token's top-k experts of p * expert(x) (+ gated shared experts)."""
    w = layer.router.weight
    experts = layer.experts
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        logits = x[t] @ w.t()
        top = torch.topk(logits, 2).indices
        p = torch.softmax(logits[top], dim=0)
        for k, e in enumerate(top.tolist()):
            up = experts.linear_fc1.weight[e] @ x[t]
            gate = experts.linear_fc1_gate.weight[e] @ x[t]
            out[t] += p[k] * (experts.linear_fc2.weight[e] @ (F.silu(gate) * up))
        shared = layer.shared_experts
        if shared is not None:
            h = F.silu(shared.linear_fc1_gate.weight @ x[t]) * (shared.linear_fc1.weight @ x[t])
            s = shared.linear_fc2.weight @ h
            if shared.gate_weight is not None:
                s = s * torch.sigmoid(shared.gate_weight[0] @ x[t])
            out[t] += s
    return out


@pytest.mark.parametrize("shared", [None, (24, False), (24, True)])
def test_layer_matches_naive_reference(shared):
    overrides = {}
    if shared is not None:
        overrides = {"moe_shared_expert_intermediate_size": shared[0], "moe_shared_expert_gate": shared[1]}
    layer = moe_layer(seed=9, **overrides).eval()
    x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        got = layer(x)
        want = _naive_layer(layer, x.reshape(-1, 32)).view(2, 6, 32)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_moe_layer_freq_places_layers():
    model = build_gpt_model(provider(num_layers=4, moe_layer_freq=2), seed=0)
    kinds = [type(model.decoder.layers[str(i)].mlp).__name__ for i in range(4)]
    assert kinds == ["MoELayer", "MLP", "MoELayer", "MLP"]
    model = build_gpt_model(provider(num_layers=4, moe_layer_freq=[0, 1, 1, 0]), seed=0)
    kinds = [type(model.decoder.layers[str(i)].mlp).__name__ for i in range(4)]
    assert kinds == ["MLP", "MoELayer", "MoELayer", "MLP"]


def test_expert_init_follows_megatron_stds_and_seed():
    layer = moe_layer(seed=11, num_layers=2, moe_ffn_hidden_size=64, num_moe_experts=8).requires_grad_(False)
    assert layer.experts.linear_fc1.weight.shape == (8, 64, 32)
    assert layer.experts.linear_fc2.weight.shape == (8, 32, 64)
    assert abs(float(layer.experts.linear_fc1.weight.std()) - 0.02) < 0.001
    assert abs(float(layer.experts.linear_fc2.weight.std()) - 0.02 / math.sqrt(2 * 2)) < 0.0006
    assert abs(float(layer.router.weight.std()) - 0.02) < 0.003
    again = moe_layer(seed=11, num_layers=2, moe_ffn_hidden_size=64, num_moe_experts=8)
    assert torch.equal(layer.experts.linear_fc1.weight, again.experts.linear_fc1.weight)
    assert not torch.equal(layer.experts.linear_fc1.weight[0], layer.experts.linear_fc1.weight[1])


@pytest.mark.parametrize(
    "overrides, error, field",
    [
        ({"moe_router_load_balancing_type": "sinkhorn"}, NotSupportedError, "moe_router_load_balancing_type"),
        ({"moe_router_topk": 5}, ConfigError, "moe_router_topk"),
        ({"moe_layer_freq": [1, 0, 1]}, ConfigError, "moe_layer_freq"),
        ({"moe_router_num_groups": 2}, ConfigError, "moe_router_group_topk"),
        ({"moe_layer_recompute": True, "recompute_granularity": "full", "recompute_method": "uniform",
          "recompute_num_layers": 1}, ConfigError, "moe_layer_recompute"),
        ({"moe_pad_expert_input_to_capacity": True}, ConfigError, "moe_expert_capacity_factor"),
    ],
)
def test_bad_moe_settings_raise_one_line(overrides, error, field):
    with pytest.raises(error) as info:
        resolve_model_args(provider(**overrides))
    assert field in str(info.value) and "\n" not in str(info.value)


def test_metrics_count_tokens_and_reset():
    model = build_gpt_model(provider(), seed=0).train()
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        model(ids, labels=ids).mean().backward()
    metrics = moe_layer_metrics(model)
    assert sorted(metrics) == [0, 1]
    for values in metrics.values():
        assert float(values["steps"]) == 3
        assert float(values["tokens_per_expert"].sum()) == 3 * 16 * 2  # steps × tokens × topk
        assert 0.9 < float(values["load_balancing_loss"]) / 3 < 2.0  # 1.0 = perfectly balanced
    with torch.no_grad():
        model.eval()
        model(ids, labels=ids)
    assert float(moe_layer_metrics(model)[0]["steps"]) == 3  # evaluation is not tracked
    reset_moe_metrics(model)
    assert float(moe_layer_metrics(model)[0]["steps"]) == 0


def test_moe_layer_recompute_replays_each_moe_layer_with_equal_grads_and_metrics_counted_once():
    """moe_layer_recompute: the MoE layer's forward runs again in backward (counted), losses and gradients are
    bit-equal to the run without it, and the metrics / expert-bias token counts are recorded once per forward."""
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    results = []
    for recompute in (False, True):
        model = build_gpt_model(provider(moe_layer_recompute=recompute, moe_z_loss_coeff=1e-3,
                                         moe_router_enable_expert_bias=True,
                                         moe_router_score_function="sigmoid"), seed=0).train()
        calls = []
        for layer in (m for m in model.modules() if isinstance(m, MoELayer)):
            layer.experts.register_forward_pre_hook(lambda *_: calls.append(1))
        losses = []
        for _ in range(2):
            loss = model(ids, labels=ids).mean()
            loss.backward()
            losses.append(loss.detach())
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        routers = [m.router.local_tokens_per_expert for m in model.modules() if isinstance(m, MoELayer)]
        results.append((torch.stack(losses), grads, moe_layer_metrics(model), routers, len(calls)))
    (loss_a, grads_a, metrics_a, counts_a, calls_a), (loss_b, grads_b, metrics_b, counts_b, calls_b) = results
    assert calls_a == 2 * 2 and calls_b == 2 * calls_a  # 2 MoE layers x 2 steps; recompute replays each once
    assert torch.equal(loss_a, loss_b)
    assert all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)
    for layer, values in metrics_a.items():
        assert float(metrics_b[layer]["steps"]) == float(values["steps"]) == 2
        assert all(torch.equal(values[k], metrics_b[layer][k]) for k in values)
    assert all(torch.equal(a, b) for a, b in zip(counts_a, counts_b))


def test_freeze_moe_router_on_tiny_moe():
    """train_utils.freeze_moe_router: router and shared-expert gate stop training, the experts keep training."""
    from longspan.recipes import get_recipe
    from longspan.training.utils.train_utils import freeze_moe_router

    cfg = get_recipe("tiny-moe")
    m = cfg.model
    m.num_layers, m.hidden_size, m.ffn_hidden_size, m.moe_ffn_hidden_size = 2, 32, 64, 16
    m.num_attention_heads, m.num_query_groups, m.seq_length, m.vocab_size = 4, 2, 8, 128
    m.moe_shared_expert_intermediate_size, m.moe_shared_expert_gate = 16, True
    model = build_gpt_model(m, seed=1).train()
    chunks = freeze_moe_router(model)
    assert chunks == [model]
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {f"decoder.layers.{i}.mlp.{leaf}" for i in (0, 1)
                      for leaf in ("router.weight", "shared_experts.gate_weight")}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    model(ids, labels=ids).mean().backward()
    optimizer.step()
    for name, p in model.named_parameters():
        changed = not torch.equal(p, before[name])
        assert changed == (name not in frozen), name
    assert model.decoder.layers["0"].mlp.router.weight.grad is None
