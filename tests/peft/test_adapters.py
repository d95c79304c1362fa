"""LoRA / DoRA / CanonicalLoRA on one process: zero-B start equals the base, only adapters train, parameter
counts, Megatron's shared-A fused layers, target matching, merging, config I/O."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import yaml

from longspan.core.errors import ConfigError
from longspan.models.gpt import build_gpt_model, init_weights
from longspan.peft import CanonicalLoRA, DoRA, LoRA
from longspan.peft.adapters import init_adapters, init_dora_magnitudes, is_adapter_key, merged_state_dict
from longspan.peft.modules import LoRALinear
from longspan.config.schema.container import ConfigContainer
from longspan.config.schema.optim import OptimizerConfig
from longspan.training.optim.optimizer import get_megatron_optimizer
from tests.helpers.adapters import perturb_adapters
from tests.models.gpt_test_config import llama_config, make_config

SEED = 7


def _adapted(cfg, peft, seed: int = SEED):
    model = build_gpt_model(cfg, materialize=False)
    peft.apply(model)
    init_weights(model, seed=seed)
    init_adapters([model], seed)
    init_dora_magnitudes([model])
    return model


def _base(cfg, seed: int = SEED):
    model = build_gpt_model(cfg, materialize=False)
    init_weights(model, seed=seed)
    return model


def _tokens(vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (2, 12), generator=g)


PEFTS = [LoRA(dim=4, alpha=8), DoRA(dim=4, alpha=8), CanonicalLoRA(dim=4, alpha=8)]
CONFIGS = {"llama": llama_config, "gpt_bias": lambda: make_config(add_bias_linear=True)}


@pytest.mark.parametrize("peft", PEFTS, ids=lambda p: type(p).__name__)
@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_zero_b_first_forward_equals_base_exactly(peft, family) -> None:
    cfg = CONFIGS[family]()
    ids = _tokens(cfg.vocab_size)
    base = _base(cfg)
    model = _adapted(cfg, peft)
    labels = torch.roll(ids, -1, 1)
    for kwargs in ({}, {"labels": labels}):  # train mode: the same dropout masks from the same generator state
        torch.manual_seed(3)
        ours = model(ids, **kwargs)
        torch.manual_seed(3)
        assert torch.equal(ours, base(ids, **kwargs))


def _expected_trainable(cfg, peft) -> int:
    """The parameter-count formula: per layer, one A (dim x in) per group and one B (out x dim) per member,
    plus (DoRA) one magnitude per output row."""
    h, ffn, r = cfg.hidden_size, cfg.ffn_hidden_size, peft.dim
    d = h // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * d, (cfg.num_query_groups or cfg.num_attention_heads) * d
    gated = cfg.gated_linear_unit
    if peft.kind == "canonical":
        groups = [(h, [q]), (h, [kv]), (h, [kv]), (q, [h]), (h, [ffn])] + ([(h, [ffn])] if gated else [])
        groups.append((ffn, [h]))
    else:
        groups = [(h, [q, kv, kv]), (q, [h]), (h, [ffn, ffn] if gated else [ffn]), (ffn, [h])]
    per_layer = sum(r * fan_in + sum(outs) * r + (sum(outs) if peft.kind == "dora" else 0) for fan_in, outs in groups)
    return cfg.num_layers * per_layer


@pytest.mark.parametrize("peft", PEFTS, ids=lambda p: type(p).__name__)
def test_trainable_parameter_count_matches_formula(peft) -> None:
    cfg = llama_config()
    model = _adapted(cfg, peft)
    trainable = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}
    assert sum(trainable.values()) == _expected_trainable(cfg, peft)
    assert all(is_adapter_key(n) for n in trainable)
    total = sum(p.numel() for p in model.parameters())
    base_total = sum(p.numel() for p in _base(cfg).parameters())
    assert total - sum(trainable.values()) == base_total


@pytest.mark.parametrize("peft", PEFTS, ids=lambda p: type(p).__name__)
def test_optimizer_step_changes_only_adapters(peft) -> None:
    cfg = llama_config()
    model = _adapted(cfg, peft)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt_cfg = OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=1.0)
    optimizer = get_megatron_optimizer(opt_cfg, [model])
    in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"]}
    assert in_optimizer == {id(p) for n, p in model.named_parameters() if is_adapter_key(n)}
    ids = _tokens(cfg.vocab_size)
    for _ in range(2):
        loss = model(ids, labels=torch.roll(ids, -1, 1)).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    for name, p in model.named_parameters():
        if is_adapter_key(name):
            if name.endswith("linear_out.weight") or name.endswith("linear_in.weight"):
                assert not torch.equal(p, before[name]), name
        else:
            assert torch.equal(p, before[name]), name
            assert p.grad is None


def test_linear_qkv_is_one_shared_a_with_b_split_over_q_k_v() -> None:
    """Megatron's fused LoRA: y_qkv = W_qkv x + s·B_qkv A x, with B_qkv's rows = [B_q; B_k; B_v]."""
    cfg = llama_config()
    model = _adapted(cfg, LoRA(dim=4, alpha=8))
    perturb_adapters(model, std=0.05)
    attn = model.decoder.layers["0"].self_attention
    names = [n for n, _ in attn.named_parameters() if "adapter" in n and "proj" not in n]
    assert sorted(names) == sorted([
        "linear_q.adapter.linear_in.weight", "linear_q.adapter.linear_out.weight",
        "linear_k.adapter.linear_out.weight", "linear_v.adapter.linear_out.weight",
    ])
    x = torch.randn(2, 5, cfg.hidden_size)
    a = attn.linear_q.adapter.linear_in.weight
    b_qkv = torch.cat([attn.linear_q.adapter.linear_out.weight, attn.linear_k.adapter.linear_out.weight,
                       attn.linear_v.adapter.linear_out.weight])
    w_qkv = torch.cat([attn.linear_q.weight, attn.linear_k.weight, attn.linear_v.weight])
    fused = F.linear(x, w_qkv) + 2.0 * F.linear(F.linear(x, a), b_qkv)
    ours = torch.cat([attn.linear_q(x), attn.linear_k(x), attn.linear_v(x)], dim=-1)
    torch.testing.assert_close(ours, fused, rtol=1e-6, atol=1e-6)
    mlp = model.decoder.layers["1"].mlp
    assert mlp.linear_fc1_gate.adapter.linear_in is None
    assert mlp.linear_fc1_gate.adapter.shared_in is mlp.linear_fc1.adapter.linear_in


def test_shared_a_group_draws_one_dropout_mask() -> None:
    """With dropout, q, k and v see the same dropped-out input (one mask), as Megatron's fused layer."""
    cfg = llama_config()
    model = _adapted(cfg, LoRA(dim=4, alpha=8, dropout=0.5))
    attn = model.decoder.layers["0"].self_attention
    seen = []
    attn.linear_q.adapter.linear_in.register_forward_hook(lambda m, args, out: seen.append(args[0]))
    x = torch.randn(2, 5, cfg.hidden_size)
    attn.train()
    torch.manual_seed(0)
    for layer in (attn.linear_q, attn.linear_k, attn.linear_v):
        layer(x)
    assert len(seen) == 1  # A x computed once for the group
    torch.manual_seed(0)
    attn.linear_q(x)
    attn.linear_q(x.clone())  # a different input is recomputed (new mask)
    assert len(seen) == 3


def test_targets_wildcards_and_excludes() -> None:
    cfg = llama_config()
    model = _adapted(cfg, LoRA(dim=2, target_modules=["*.layers.0.*.linear_qkv", "linear_fc2"]))
    adapted = {n for n, m in model.named_modules() if isinstance(m, LoRALinear)}
    assert adapted == {
        "decoder.layers.0.self_attention.linear_q", "decoder.layers.0.self_attention.linear_k",
        "decoder.layers.0.self_attention.linear_v", "decoder.layers.0.mlp.linear_fc2",
        "decoder.layers.1.mlp.linear_fc2",
    }
    model = _adapted(cfg, LoRA(dim=2, target_modules=[], exclude_modules=["linear_qkv", "*.layers.1.*"]))
    adapted = {n for n, m in model.named_modules() if isinstance(m, LoRALinear)}
    assert adapted == {"decoder.layers.0.self_attention.linear_proj", "decoder.layers.0.mlp.linear_fc1",
                       "decoder.layers.0.mlp.linear_fc1_gate", "decoder.layers.0.mlp.linear_fc2"}
    model = _adapted(cfg, CanonicalLoRA(dim=2, target_modules=["linear_v", "linear_fc1_up"]))
    adapted = {n for n, m in model.named_modules() if isinstance(m, LoRALinear)}
    assert adapted == {f"decoder.layers.{i}.{leaf}" for i in (0, 1)
                       for leaf in ("self_attention.linear_v", "mlp.linear_fc1")}
    assert model.decoder.layers["0"].mlp.linear_fc1.adapter.linear_in is not None  # canonical: its own A


@pytest.mark.parametrize("bad, match", [
    (LoRA(target_modules=["linear_qvk"]), "entry 'linear_qvk' names no layer LoRA can adapt"),
    # one misspelt name beside valid ones is refused too (it would adapt nothing, silently)
    (LoRA(target_modules=["linear_qkv", "linear_fc_1"]), "entry 'linear_fc_1' names no layer"),
    (LoRA(target_modules=["linear_q", "linear_fc2"]), r"'linear_q' is CanonicalLoRA's naming"),
    (CanonicalLoRA(target_modules=["linear_q", "linear_fc1_up", "linear_kv"]), "entry 'linear_kv' names no layer"),
    (LoRA(target_modules=["linear_qkv", "in_proj_z"]), r"'in_proj_z' is CanonicalLoRA's naming"),
    (LoRA(target_modules=[], exclude_modules=["experts"]), "exclude_modules entry 'experts'"),
    (LoRA(target_modules=["*.layers.9.*"]), "matches no linear layer"),
    (CanonicalLoRA(target_modules=["linear_qkv"]), "fused modules"),
    (LoRA(dim=0), "dim=0"),
    (LoRA(dropout=1.5), "dropout=1.5"),
    (LoRA(lora_A_init_method="uniform"), "lora_A_init_method='uniform'"),
    (DoRA(dropout_position="post"), "only 'pre'"),
    (LoRA(target_modules=[]), "target_modules is empty"),
])
def test_bad_configs_are_one_line_errors(bad, match) -> None:
    model = build_gpt_model(llama_config(), materialize=False)
    with pytest.raises(ConfigError, match=match):
        bad.apply(model)


def test_names_the_model_lacks_are_accepted_beside_ones_it_has() -> None:
    """Recipes list targets for several architectures (Bridge's MoE LoRA names multi-latent attention's and the
    Mamba mixers' too): a valid name the model lacks adapts nothing and is no error."""
    model = build_gpt_model(llama_config(), materialize=False)
    LoRA(dim=2, target_modules=["linear_qkv", "linear_kv_down_proj", "in_proj", "decoder.layers.0.mlp.linear_fc1"]
         ).apply(model)
    adapted = {n for n, m in model.named_modules() if isinstance(m, LoRALinear)}
    assert adapted == {"decoder.layers.0.mlp.linear_fc1", "decoder.layers.0.mlp.linear_fc1_gate"} | {
        f"decoder.layers.{i}.self_attention.linear_{p}" for i in (0, 1) for p in "qkv"}


@pytest.mark.parametrize("peft", PEFTS, ids=lambda p: type(p).__name__)
def test_merged_weights_give_the_adapted_outputs(peft) -> None:
    cfg = make_config(add_bias_linear=True, gated_linear_unit=True)
    model = _adapted(cfg, peft)
    perturb_adapters(model, std=0.05)
    model.eval()
    ids = _tokens(cfg.vocab_size)
    merged = build_gpt_model(cfg, materialize=False)
    merged.to_empty(device="cpu")
    merged.load_state_dict(merged_state_dict(model))
    merged.eval()
    torch.testing.assert_close(merged(ids), model(ids), rtol=1e-5, atol=1e-5)
    assert not torch.equal(merged(ids), _base(cfg).eval()(ids))


def test_init_methods_follow_megatron_bridge() -> None:
    cfg = llama_config(hidden_size=256, num_attention_heads=4, ffn_hidden_size=512)
    model = _adapted(cfg, LoRA(dim=64, lora_A_init_method="xavier"))
    a = model.decoder.layers["0"].self_attention.linear_proj.adapter.linear_in.weight
    assert abs(a.std().item() - (2.0 / (256 + 64)) ** 0.5) < 0.005  # xavier normal
    assert torch.count_nonzero(model.decoder.layers["0"].self_attention.linear_proj.adapter.linear_out.weight) == 0
    model = _adapted(cfg, LoRA(dim=64, lora_A_init_method="kaiming", lora_B_init_method="normal"))
    layer = model.decoder.layers["0"].self_attention.linear_proj.adapter
    assert layer.linear_in.weight.abs().max().item() <= 1 / 256 ** 0.5
    assert abs(layer.linear_out.weight.std().item() - 0.2) < 0.01
    again = _adapted(cfg, LoRA(dim=64, lora_A_init_method="kaiming", lora_B_init_method="normal"))
    assert torch.equal(again.decoder.layers["0"].self_attention.linear_proj.adapter.linear_in.weight,
                       layer.linear_in.weight)  # per-name seed streams


@pytest.mark.parametrize("peft", [LoRA(dim=8, target_modules=["*.layers.0.*.linear_qkv"], dropout=0.1),
                                  DoRA(dim=16, alpha=32), CanonicalLoRA(exclude_modules=["linear_k"])],
                         ids=lambda p: type(p).__name__)
def test_peft_round_trips_through_yaml(peft) -> None:
    from longspan.recipes import get_recipe

    cfg = get_recipe("tiny")
    cfg.peft = peft
    text = cfg.to_yaml()
    back = ConfigContainer.from_dict(yaml.safe_load(text))
    assert back.peft == peft and type(back.peft) is type(peft)
    assert back.to_yaml() == text


@pytest.mark.parametrize("target, cls", [("megatron.bridge.peft.lora.LoRA", LoRA),
                                         ("megatron.bridge.peft.dora.DoRA", DoRA),
                                         ("megatron.bridge.peft.canonical_lora.CanonicalLoRA", CanonicalLoRA)])
def test_bridge_targets_map_onto_longspan_classes(target, cls) -> None:
    from longspan.config.overrides import apply_overrides
    from longspan.recipes import get_recipe

    data = get_recipe("tiny").to_dict()
    data["peft"] = {"_target_": target, "dim": 16, "alpha": 32, "dropout": 0.05, "target_modules": ["linear_qkv"]
                    if cls is not CanonicalLoRA else ["linear_q"]}
    cfg = ConfigContainer.from_dict(data)
    assert type(cfg.peft) is cls and cfg.peft.dim == 16 and cfg.peft.dropout == 0.05
    apply_overrides(cfg, ["peft.dim=4"])
    assert cfg.peft.dim == 4


def _moe_provider():
    from longspan.models.gpt_provider import GPTModelProvider

    return GPTModelProvider(
        num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, seq_length=8, vocab_size=128,
        make_vocab_size_divisible_by=128, normalization="RMSNorm", position_embedding_type="rope",
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16,
        moe_shared_expert_intermediate_size=24,
    )


def test_moe_routed_experts_take_per_expert_adapters() -> None:
    """Routed experts (GroupedLinear [E, out, in]): per-expert 3-D A/B; zero B starts at the base; a step moves
    only adapters; the fused linear_fc1 shares each expert's A between gate and up; merging folds them in."""
    cfg = _moe_provider()
    ids = _tokens(128)
    model = _adapted(cfg, LoRA(dim=2, alpha=4))
    experts = model.decoder.layers["0"].mlp.experts
    assert experts.linear_fc1.adapter.linear_in.weight.shape == (4, 2, 32)
    assert experts.linear_fc1.adapter.linear_out.weight.shape == (4, 16, 2)
    assert experts.linear_fc1_gate.adapter.linear_in is None  # gate reads up's A (Megatron's fused fc1)
    assert experts.linear_fc2.adapter.linear_in.weight.shape == (4, 2, 16)
    assert "decoder.layers.0.mlp.shared_experts.linear_fc1" in {
        n for n, m in model.named_modules() if isinstance(m, LoRALinear)}
    assert torch.equal(model(ids), _base(cfg)(ids))

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-2), [model])
    model(ids, labels=torch.roll(ids, -1, 1)).mean().backward()
    optimizer.step()
    for name, p in model.named_parameters():
        moved = not torch.equal(p, before[name])
        assert moved == is_adapter_key(name) or (is_adapter_key(name) and "linear_in" in name), name
    assert not torch.equal(experts.linear_fc2.adapter.linear_out.weight,
                           before["decoder.layers.0.mlp.experts.linear_fc2.adapter.linear_out.weight"])

    perturb_adapters(model, std=0.05)
    model.eval()
    merged = build_gpt_model(cfg, materialize=False)
    merged.to_empty(device="cpu")
    merged.load_state_dict(merged_state_dict(model))
    torch.testing.assert_close(merged.eval()(ids), model(ids), rtol=1e-5, atol=1e-5)


def test_moe_shared_experts_adapt_and_grouped_experts_are_rejected_by_name() -> None:
    from longspan.core.errors import NotSupportedError

    cfg = _moe_provider()
    with pytest.raises(NotSupportedError, match=r"decoder\.layers\.0\.mlp\.experts\.linear_fc1 .*exclude_modules"):
        DoRA(dim=2).apply(build_gpt_model(cfg, materialize=False))
    peft = LoRA(dim=2, exclude_modules=["*.experts.*"])
    model = _adapted(cfg, peft)
    adapted = {n for n, m in model.named_modules() if isinstance(m, LoRALinear)}
    assert "decoder.layers.0.mlp.shared_experts.linear_fc1" in adapted
    assert "decoder.layers.0.mlp.shared_experts.linear_fc1_gate" in adapted
    assert not any(".experts." in n for n in adapted)
    ids = _tokens(128)
    base = _base(cfg)
    assert torch.equal(model(ids), base(ids))
