"""DeepSeek-V3 routing in the MoE layer against megatron-core's functions (the oracle): the aux-loss-free expert
bias (selection only, sigmoid scores, group-limited top-k, scaling factor), its update from the step's token
counts, device-limited routing, input jitter, the token-dropping switch; counts skip evaluation and
activation-recompute replays; the bias is a float32 persistent buffer."""

from __future__ import annotations

import types
import warnings

import pytest
import torch

from longspan.core.errors import ConfigError
from longspan.models.args import MoEArgs
from longspan.models.gpt import build_gpt_model, resolve_model_args
from longspan.models.moe import moe_layers
from longspan.models.moe_router import TopKRouter, drop_tokens, set_aux_loss_scale, updated_expert_bias
from longspan.parallel.expert_parallel import update_expert_biases
from tests.models.test_moe import moe_layer, provider

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.transformer.moe import moe_utils as mcore
    from megatron.core.transformer.moe.router import TopKRouter as McoreTopKRouter

SIGMOID_BIAS = {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True}


@pytest.fixture(autouse=True)
def _unit_aux_scale():
    set_aux_loss_scale(1.0)
    yield
    set_aux_loss_scale(1.0)


def _random_bias(layer, seed: int, scale: float = 0.3) -> torch.Tensor:
    bias = torch.randn(layer.num_experts, generator=torch.Generator().manual_seed(seed)) * scale
    layer.router.expert_bias.copy_(bias)
    return bias


# ------------------------------------------------------------------------------------------- routing vs mcore

@pytest.mark.parametrize(
    "overrides, mcore_kwargs",
    [
        ({}, {}),
        ({"moe_router_topk": 1}, {}),
        ({"moe_router_topk_scaling_factor": 2.5}, {"scaling_factor": 2.5}),
        ({"num_moe_experts": 8, "moe_router_topk": 4, "moe_router_num_groups": 4, "moe_router_group_topk": 2,
          "moe_router_topk_scaling_factor": 2.5}, {"num_groups": 4, "group_topk": 2, "scaling_factor": 2.5}),
        ({"num_moe_experts": 8, "moe_router_topk": 2, "moe_router_dtype": "fp64"}, {}),
    ],
)
def test_biased_sigmoid_routing_matches_megatron(overrides, mcore_kwargs):
    """Random non-zero biases on 37 tokens: megatron-core's routing map and weights, and the bias changed the
    map (so a bias that is dropped or added to the weights would fail)."""
    layer = moe_layer(**SIGMOID_BIAS, **overrides).eval()
    bias = _random_bias(layer, seed=4)
    dtype = layer.router.moe.router_dtype or torch.float32
    logits = torch.randn(37, layer.num_experts, generator=torch.Generator().manual_seed(3), dtype=dtype)
    probs, routing_map, _ = layer.router.routing(logits)
    topk = layer.router.moe.topk
    want_probs, want_map = mcore.topk_routing_with_score_function(
        logits, topk, score_function="sigmoid", expert_bias=bias, **mcore_kwargs)
    assert torch.equal(routing_map, want_map)
    torch.testing.assert_close(probs, want_probs, rtol=1e-6, atol=1e-7)
    unbiased_map = mcore.topk_routing_with_score_function(logits, topk, score_function="sigmoid", **mcore_kwargs)[1]
    assert not torch.equal(routing_map, unbiased_map)


def test_bias_chooses_experts_but_not_weights():
    """A huge bias on one expert puts it in every token's top-k, with its unbiased (normalized) score."""
    layer = moe_layer(**SIGMOID_BIAS).eval()
    layer.router.expert_bias.copy_(torch.tensor([0.0, 0.0, 100.0, 0.0]))
    logits = torch.randn(9, 4, generator=torch.Generator().manual_seed(0))
    probs, routing_map, _ = layer.router.routing(logits)
    assert bool(routing_map[:, 2].all())
    scores = torch.sigmoid(logits)
    chosen = scores * routing_map
    torch.testing.assert_close(probs, chosen / chosen.sum(dim=-1, keepdim=True))


# ------------------------------------------------------------------------------------------- bias update

def _mcore_updated_bias(counts: torch.Tensor, bias: torch.Tensor, rate: float, monkeypatch) -> torch.Tensor:
    """megatron-core's get_updated_expert_bias on one process (its all-reduce over one rank is the identity)."""
    monkeypatch.setattr(mcore.torch.distributed, "all_reduce", lambda tensor, group=None: None)
    monkeypatch.setattr(mcore.parallel_state, "get_tensor_and_data_parallel_group", lambda **kwargs: None)
    return mcore.get_updated_expert_bias(counts.clone(), bias, rate)


def test_bias_update_matches_megatron(monkeypatch):
    g = torch.Generator().manual_seed(1)
    counts = torch.randint(0, 50, (3, 8), generator=g).float()
    counts[1] = 12.0  # every expert at the mean: no change
    counts[2, :4] = torch.tensor([10.0, 30.0, 20.0, 20.0])
    bias = torch.randn(3, 8, generator=g)
    got = updated_expert_bias(counts, bias, 1e-3)
    torch.testing.assert_close(got, _mcore_updated_bias(counts, bias, 1e-3, monkeypatch), rtol=0, atol=0)
    assert torch.equal(got[1], bias[1])


def _train_forwards(model, microbatches: int, seed: int = 0) -> None:
    ids = torch.randint(0, 128, (microbatches, 3, 7), generator=torch.Generator().manual_seed(seed))
    for k in range(microbatches):
        model(ids[k], labels=ids[k]).mean().backward()


def test_step_update_uses_the_counts_of_every_microbatch(monkeypatch):
    """Three microbatches (uneven: 21 tokens each, top-2 of 4) then one update: megatron-core's update of the
    summed routing maps, per layer; the counts reset; the next step's routing uses the new bias."""
    model = build_gpt_model(provider(**SIGMOID_BIAS, moe_router_bias_update_rate=0.05), seed=0).train()
    layers = moe_layers(model)
    seen: dict[int, torch.Tensor] = {}

    def record(layer_index):
        def hook(module, args, output):
            seen[layer_index] = seen.get(layer_index, 0) + output[1].sum(dim=0).float()
        return hook

    for i, layer in enumerate(layers):
        layer.router.register_forward_hook(record(i))
        _random_bias(layer, seed=10 + i, scale=0.1)
    before = [layer.router.expert_bias.clone() for layer in layers]
    _train_forwards(model, 3)
    for i, layer in enumerate(layers):
        assert torch.equal(layer.router.local_tokens_per_expert, seen[i])
        assert float(seen[i].sum()) == 3 * 21 * 2
    update_expert_biases(model)
    for i, layer in enumerate(layers):
        want = _mcore_updated_bias(seen[i], before[i], 0.05, monkeypatch)
        assert torch.equal(layer.router.expert_bias, want)
        assert not torch.equal(want, before[i])
        assert layer.router.local_tokens_per_expert is None
    update_expert_biases(model)  # a step without training forwards: counts zero, every expert at the mean
    assert all(torch.equal(layer.router.expert_bias, layers_bias) for layer, layers_bias in
               zip(layers, [_mcore_updated_bias(seen[i], before[i], 0.05, monkeypatch) for i in range(2)]))


def test_evaluation_and_recompute_do_not_count_tokens():
    """No counts under no_grad (evaluation); full activation recompute replays every layer's forward during
    backward, which must not count again: the counts equal those of a run without recompute."""
    plain = build_gpt_model(provider(**SIGMOID_BIAS), seed=0).train()
    recompute = build_gpt_model(provider(**SIGMOID_BIAS, recompute_granularity="full", recompute_method="uniform",
                                         recompute_num_layers=1), seed=0).train()
    with torch.no_grad():
        plain(torch.zeros(2, 5, dtype=torch.long))
    assert all(layer.router.local_tokens_per_expert is None for layer in moe_layers(plain))
    _train_forwards(plain, 2)
    _train_forwards(recompute, 2)
    for a, b in zip(moe_layers(plain), moe_layers(recompute)):
        assert torch.equal(a.router.local_tokens_per_expert, b.router.local_tokens_per_expert)
        assert a.metric_steps == b.metric_steps == 2


def test_bias_buffer_is_persistent_float32_and_zero_at_start():
    model = build_gpt_model(provider(**SIGMOID_BIAS), seed=0)
    keys = [k for k in model.state_dict() if k.endswith("expert_bias")]
    assert keys == ["decoder.layers.0.mlp.router.expert_bias", "decoder.layers.1.mlp.router.expert_bias"]
    layer = moe_layers(model)[0]
    assert torch.equal(layer.router.expert_bias, torch.zeros(4))  # meta-built, materialized: zero, not garbage
    _random_bias(layer, seed=2)
    model.to(torch.bfloat16)
    assert layer.router.expert_bias.dtype == torch.float32  # selection precision kept, as megatron-core does
    other = build_gpt_model(provider(**SIGMOID_BIAS), seed=1)
    other.load_state_dict(model.state_dict())
    assert torch.equal(moe_layers(other)[0].router.expert_bias, layer.router.expert_bias)
    assert "expert_bias" not in dict(moe_layers(build_gpt_model(provider(), seed=0))[0].named_buffers())


# ------------------------------------------------------------------------------------------- device-limited routing

def test_device_limited_routing_is_group_limited_with_one_group_per_ep_rank():
    """moe_router_topk_limited_devices=M with EP ranks as groups, as megatron-core's TransformerConfig maps it;
    the routing equals group_limited_topk's and every token's experts sit on at most M ranks."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mc = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_moe_experts=8,
                               moe_router_topk=2, moe_router_topk_limited_devices=1, expert_model_parallel_size=4,
                               moe_router_pre_softmax=True)
    p = provider(num_moe_experts=8, moe_router_topk=2, moe_router_topk_limited_devices=1,
                 expert_model_parallel_size=4, moe_router_pre_softmax=True)
    moe = resolve_model_args(p).moe
    assert (moe.num_groups, moe.group_topk) == (mc.moe_router_num_groups, mc.moe_router_group_topk) == (4, 1)
    router = TopKRouter(32, moe, 0.02, torch.float32).eval()
    logits = torch.randn(45, 8, generator=torch.Generator().manual_seed(5))
    probs, routing_map, _ = router.routing(logits)
    want_probs, want_map = mcore.topk_routing_with_score_function(logits, 2, use_pre_softmax=True, num_groups=4,
                                                                  group_topk=1)
    assert torch.equal(routing_map, want_map)
    torch.testing.assert_close(probs, want_probs)
    ranks_per_token = routing_map.view(45, 4, 2).any(dim=-1).sum(dim=-1)
    assert int(ranks_per_token.max()) == 1
    assert not torch.equal(routing_map, mcore.topk_routing_with_score_function(logits, 2, use_pre_softmax=True)[1])


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"moe_router_topk_limited_devices": 1, "moe_router_num_groups": 2, "moe_router_group_topk": 1},
         "moe_router_topk_limited_devices"),
        ({"moe_router_topk_limited_devices": 2, "expert_model_parallel_size": 1}, "moe_router_topk_limited_devices"),
        ({"moe_router_enable_expert_bias": True}, "moe_router_score_function"),
        ({**SIGMOID_BIAS, "moe_router_bias_update_rate": -1.0}, "moe_router_bias_update_rate"),
        ({"moe_input_jitter_eps": 0.0}, "moe_input_jitter_eps"),
        ({"moe_input_jitter_eps": 1.5}, "moe_input_jitter_eps"),
        ({"moe_token_dropping": True}, "moe_expert_capacity_factor"),
        ({**SIGMOID_BIAS, "moe_expert_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": True},
         "moe_pad_expert_input_to_capacity"),
    ],
)
def test_bad_routing_settings_raise_one_line(overrides, field):
    with pytest.raises(ConfigError) as info:
        resolve_model_args(provider(**overrides))
    assert field in str(info.value) and "\n" not in str(info.value)


# ------------------------------------------------------------------------------------------- jitter, dropping

def test_input_jitter_is_megatrons_draw_and_training_only():
    """Training: the router sees x times megatron-core's Uniform(1-eps, 1+eps) draw from the same generator
    state (the experts see x unchanged); evaluation: no noise."""
    layer = moe_layer(moe_input_jitter_eps=0.1)
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(1))
    seen: list[torch.Tensor] = []
    layer.router.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    gated: list[torch.Tensor] = []
    layer.router.register_forward_hook(lambda module, args, out: None)
    original_gating = layer.router.gating
    layer.router.gating = lambda inp: gated.append(inp) or original_gating(inp)
    torch.manual_seed(42)
    layer.train()(x)
    fake = types.SimpleNamespace(config=types.SimpleNamespace(moe_input_jitter_eps=0.1), input_jitter=None)
    torch.manual_seed(42)
    want = McoreTopKRouter.apply_input_jitter(fake, x.reshape(-1, 32))
    assert torch.equal(gated[0], want) and not torch.equal(gated[0], seen[0])
    layer.eval()(x)
    assert torch.equal(gated[1], x.reshape(-1, 32))


def test_input_jitter_replays_under_recompute():
    """Activation recompute restores the generator, so jittered training gets the same gradients with it."""
    grads = []
    for extra in ({}, {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}):
        model = build_gpt_model(provider(moe_input_jitter_eps=0.2, **extra), seed=0).train()
        torch.manual_seed(3)
        _train_forwards(model, 1)
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)
    torch.manual_seed(3)
    plain = build_gpt_model(provider(), seed=0).train()
    _train_forwards(plain, 1)
    assert not torch.equal(grads[0], torch.cat([p.grad.flatten() for p in plain.parameters()]))


def test_token_dropping_switch_is_the_capacity_dropping():
    """moe_token_dropping=True with a capacity factor is megatron-core's apply_router_token_dropping."""
    plain = moe_layer(moe_expert_capacity_factor=0.5)
    switched = moe_layer(moe_expert_capacity_factor=0.5, moe_token_dropping=True)
    logits = torch.randn(30, 4, generator=torch.Generator().manual_seed(2))
    got_p, got_m, _ = switched.eval().router.routing(logits)
    assert torch.equal(got_m, plain.eval().router.routing(logits)[1])
    probs, routing_map = mcore.topk_routing_with_score_function(logits, 2)
    want_p, want_m = mcore.apply_router_token_dropping(probs, routing_map, 2, 0.5, "probs", False)
    assert torch.equal(got_m, want_m)
    torch.testing.assert_close(got_p, want_p)
    assert torch.equal(drop_tokens(probs, routing_map, 2, 0.5, "probs", False)[1], want_m)


def test_moe_args_carry_the_new_fields():
    moe = MoEArgs.from_config(provider(**SIGMOID_BIAS, moe_router_bias_update_rate=0.01, moe_input_jitter_eps=0.05),
                              2, 64)
    assert (moe.expert_bias, moe.bias_update_rate, moe.input_jitter_eps) == (True, 0.01, 0.05)
