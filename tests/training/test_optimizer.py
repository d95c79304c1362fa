"""MegatronOptimizer / get_megatron_optimizer / grad scalers against torch's own optimizers and written-out rules."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from longspan.config.schema.optim import OptimizerConfig
from longspan.core.errors import ConfigError, NotSupportedError
from longspan.training.optim.grad_scaler import ConstantGradScaler, DynamicGradScaler
from longspan.training.optim.optimizer import MegatronOptimizer, get_megatron_optimizer, get_param_groups
from longspan.training.optim.scheduler import OptimizerParamScheduler
from tests.parallel.harness import get_shared_pool, init_gloo


def opt_config(**kw) -> OptimizerConfig:
    """An OptimizerConfig with the values these tests start from."""
    fields = dict(
        optimizer="adam", lr=1e-2, min_lr=0.0, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8,
        sgd_momentum=0.9, clip_grad=0.0, bf16=False, fp16=False, params_dtype=torch.float32, loss_scale=None,
        initial_loss_scale=2**32, min_loss_scale=1.0, loss_scale_window=1000, hysteresis=2,
        use_distributed_optimizer=False, log_num_zeros_in_grad=False, decoupled_weight_decay=True,
        decoupled_lr=None, decoupled_min_lr=None,
    )
    fields.update(kw)
    return OptimizerConfig(**fields)


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(10, 8)
        self.linear = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 10, bias=False)
        self.frozen = nn.Parameter(torch.ones(3, 3), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(torch.relu(self.linear(self.embedding(x)))))


def tiny(seed: int = 0) -> Tiny:
    torch.manual_seed(seed)
    return Tiny()


def fill_grads(model: nn.Module, seed: int, scale: float = 1.0) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype) * scale


def names_in(group: dict, model: nn.Module) -> set[str]:
    ids = {id(p) for p in group["params"]}
    return {n for n, p in model.named_parameters() if id(p) in ids}


# ---------------------------------------------------------------------------- param groups
def test_param_groups_exclude_biases_and_norms_from_weight_decay():
    model = tiny()
    opt = get_megatron_optimizer(opt_config(), [model])
    assert len(opt.param_groups) == 2
    decay, no_decay = opt.param_groups
    assert decay["wd_mult"] == 1.0 and no_decay["wd_mult"] == 0.0
    assert names_in(decay, model) == {"embedding.weight", "linear.weight", "head.weight"}
    assert names_in(no_decay, model) == {"linear.bias", "norm.weight", "norm.bias"}
    for g in opt.param_groups:
        assert (g["max_lr"], g["min_lr"], g["lr_mult"], g["default_config"]) == (1e-2, 0.0, 1.0, True)
    assert "frozen" not in names_in(decay, model) | names_in(no_decay, model)


def test_custom_conditions_and_lr_mult_become_group_max_min_lr():
    model = tiny()
    opt = get_megatron_optimizer(
        opt_config(lr=1e-3, min_lr=1e-4),
        [model],
        no_weight_decay_cond=lambda name, p: name.startswith("embedding"),
        scale_lr_cond=lambda name, p: name.startswith("head"),
        lr_mult=0.1,
    )
    by_names = {frozenset(names_in(g, model)): g for g in opt.param_groups}
    head = by_names[frozenset({"head.weight"})]
    assert head["max_lr"] == pytest.approx(1e-4) and head["min_lr"] == pytest.approx(1e-5)
    assert head["lr_mult"] == 0.1 and head["wd_mult"] == 1.0 and head["default_config"] is False
    emb = by_names[frozenset({"embedding.weight"})]
    assert emb["wd_mult"] == 0.0 and emb["max_lr"] == 1e-3
    rest = by_names[frozenset({"linear.weight", "linear.bias", "norm.weight", "norm.bias"})]
    assert rest["wd_mult"] == 1.0  # the custom rule replaces the default one


def test_bias_and_norm_do_not_decay_but_weights_do():
    model = tiny()
    before = copy.deepcopy(model)
    opt = get_megatron_optimizer(opt_config(lr=0.1, weight_decay=0.5), [model])
    OptimizerParamScheduler(opt, 0.0, 0.1, 0.0, 0, 100, "constant", 0.5, 0.5, 100, "constant")
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    ok, norm, _ = opt.step()
    assert ok and norm == 0.0
    for (name, p), p0 in zip(model.named_parameters(), before.parameters()):
        if name in ("linear.bias", "norm.weight", "norm.bias", "frozen"):
            torch.testing.assert_close(p, p0, rtol=0, atol=0)
        else:  # AdamW with zero grad: only the decoupled decay p *= 1 - lr * wd
            torch.testing.assert_close(p, p0 * (1 - 0.1 * 0.5))


# ---------------------------------------------------------------------------- step equals torch's optimizers
def _reference_groups(model: nn.Module, wd: float) -> list[dict]:
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim > 1]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim == 1]
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]


@pytest.mark.parametrize("kind", ["adamw", "adam", "sgd"])
def test_step_equals_torch_optimizer(kind):
    cfg = opt_config(
        optimizer="sgd" if kind == "sgd" else "adam", decoupled_weight_decay=kind != "adam", weight_decay=0.1
    )
    ours_model, ref_model = tiny(), tiny()
    opt = get_megatron_optimizer(cfg, [ours_model])
    groups = _reference_groups(ref_model, 0.1)
    if kind == "adamw":
        ref = torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, foreach=True)
        assert isinstance(opt.optimizer, torch.optim.AdamW)
    elif kind == "adam":
        ref = torch.optim.Adam(groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, foreach=True)
        assert type(opt.optimizer) is torch.optim.Adam
    else:
        ref = torch.optim.SGD(groups, lr=1e-2, momentum=0.9, foreach=True)
    for step in range(4):
        fill_grads(ours_model, step)
        fill_grads(ref_model, step)
        ok, _, zeros = opt.step()
        ref.step()
        assert ok and zeros is None
    for p, q in zip(ours_model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert not torch.equal(ours_model.linear.weight, tiny().linear.weight)


# ---------------------------------------------------------------------------- clipping and zeros
def test_clipping_matches_torch_clip_grad_norm():
    model = tiny()
    opt = get_megatron_optimizer(opt_config(clip_grad=1.0), [model])
    fill_grads(model, 1, scale=3.0)
    copies = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    # clip_grad_norm_ works on parameters; give it stand-ins holding copies of the grads.
    stand_ins = [nn.Parameter(torch.zeros_like(g)) for g in copies]
    for s, g in zip(stand_ins, copies):
        s.grad = g
    expected = float(torch.nn.utils.clip_grad_norm_(stand_ins, 1.0))
    assert expected > 1.0
    assert opt.clip_grad_norm(1.0) == pytest.approx(expected, rel=1e-6)
    for p, s in zip([p for p in model.parameters() if p.grad is not None], stand_ins):
        torch.testing.assert_close(p.grad, s.grad)
    assert opt.get_grad_norm() == pytest.approx(1.0, rel=1e-5)


def test_grad_norm_skips_parameters_marked_shared():
    model = tiny()
    opt = get_megatron_optimizer(opt_config(clip_grad=0.0), [model])
    fill_grads(model, 3, scale=2.0)
    model.linear.weight.shared = True  # e.g. the last pipeline stage's copy of a tied embedding
    others = [p.grad for p in model.parameters() if p.grad is not None and p is not model.linear.weight]
    expected = torch.sqrt(sum((g.double() ** 2).sum() for g in others)).item()
    assert opt.get_grad_norm() == pytest.approx(expected, rel=1e-6)


def test_step_returns_norm_without_clipping_and_counts_zeros():
    model = tiny()
    opt = get_megatron_optimizer(opt_config(clip_grad=0.0, log_num_zeros_in_grad=True), [model])
    fill_grads(model, 2, scale=5.0)
    model.linear.weight.grad[:3] = 0.0
    model.norm.bias.grad[:2] = 0.0
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    expected_norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads)).item()
    ok, norm, zeros = opt.step()
    assert ok
    assert norm == pytest.approx(expected_norm, rel=1e-6)
    assert zeros == 3 * 8 + 2


# ---------------------------------------------------------------------------- loss scaling
def test_dynamic_scaler_rules():
    s = DynamicGradScaler(initial_scale=2.0**10, min_scale=2.0**8, growth_factor=2.0, backoff_factor=0.5,
                          growth_interval=3, hysteresis=2)
    s.update(True)
    assert s.scale.item() == 2.0**10  # first overflow: hysteresis absorbs it
    s.update(False)  # a clean step does not restore the hysteresis budget
    s.update(True)
    assert s.scale.item() == 2.0**9
    s.update(True)
    assert s.scale.item() == 2.0**8
    s.update(True)
    assert s.scale.item() == 2.0**8  # floor at min_scale
    for _ in range(2):
        s.update(False)
    assert s.scale.item() == 2.0**8
    s.update(False)  # third clean step in a row: grow and reset hysteresis
    assert s.scale.item() == 2.0**9
    assert s.state_dict()["hysteresis_tracker"] == 2 and s.state_dict()["growth_tracker"] == 0
    c = ConstantGradScaler(128.0)
    c.update(True)
    assert c.scale.item() == 128.0 and c.state_dict() == {}
    with pytest.raises(ConfigError, match="min_loss_scale"):
        DynamicGradScaler(1.0, 2.0, 2.0, 0.5, 10, 2)


def _fp16_optimizer(model: nn.Module, **kw) -> MegatronOptimizer:
    cfg = opt_config(fp16=True, initial_loss_scale=2.0**12, loss_scale_window=3, hysteresis=2, clip_grad=1.0, **kw)
    return get_megatron_optimizer(cfg, [model])


def test_fp16_inf_grads_skip_update_and_scale_halves_after_hysteresis():
    model = tiny()
    opt = _fp16_optimizer(model)
    assert isinstance(opt.grad_scaler, DynamicGradScaler)
    before = copy.deepcopy(model)
    scales = []
    for _ in range(3):
        fill_grads(model, 0)
        model.linear.weight.grad[0, 0] = float("inf")
        assert opt.step() == (False, None, None)
        scales.append(opt.get_loss_scale().item())
    assert scales == [2.0**12, 2.0**11, 2.0**10]
    for p, p0 in zip(model.parameters(), before.parameters()):
        assert torch.equal(p, p0)
    fill_grads(model, 0)
    model.norm.weight.grad[1] = float("nan")
    assert opt.step()[0] is False
    # Three clean steps in a row: the scale doubles.
    for i in range(3):
        fill_grads(model, i)
        assert opt.step()[0] is True
    assert opt.get_loss_scale().item() == 2.0**10


def test_fp16_scaled_loss_gives_the_unscaled_update():
    model, ref_model = tiny(), tiny()
    opt = _fp16_optimizer(model)
    ref_opt = get_megatron_optimizer(opt_config(clip_grad=1.0), [ref_model])
    x = torch.tensor([[1, 2, 3], [4, 5, 6]])
    loss = model(x).float().pow(2).mean()
    scaled = opt.scale_loss(loss)
    assert scaled.item() == pytest.approx(loss.item() * 2.0**12, rel=1e-6)
    scaled.backward()
    ref_model(x).float().pow(2).mean().backward()
    ok, norm, _ = opt.step()
    ok_ref, norm_ref, _ = ref_opt.step()
    assert ok and ok_ref
    assert norm == pytest.approx(norm_ref, rel=1e-5)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_constant_loss_scale_and_bf16_without_scaler():
    assert isinstance(get_megatron_optimizer(opt_config(fp16=True, loss_scale=64.0), [tiny()]).grad_scaler,
                      ConstantGradScaler)
    bf16 = get_megatron_optimizer(opt_config(bf16=True), [tiny()])
    assert bf16.grad_scaler is None and bf16.get_loss_scale().item() == 1.0
    assert get_megatron_optimizer(opt_config(), [tiny()]).grad_scaler is None


def test_state_dict_round_trip_with_scaler():
    model = tiny()
    opt = _fp16_optimizer(model)
    for i in range(2):
        fill_grads(model, i)
        opt.step()
    fill_grads(model, 9)
    model.head.weight.grad[0, 0] = float("inf")
    opt.step()  # skipped: hysteresis tracker now 1, growth tracker 0
    sd = copy.deepcopy(opt.state_dict())
    assert sd["grad_scaler"]["hysteresis_tracker"] == 1
    assert set(sd) == {"optimizer", "grad_scaler"}

    model2 = copy.deepcopy(model)
    opt2 = _fp16_optimizer(model2)
    opt2.load_state_dict(sd)
    assert opt2.grad_scaler.state_dict()["hysteresis_tracker"] == 1
    assert opt2.get_loss_scale().item() == opt.get_loss_scale().item()
    for step in range(3):
        for m in (model, model2):
            fill_grads(m, 20 + step)
        model.head.weight.grad[0, 0] = model2.head.weight.grad[0, 0] = float("inf") if step == 0 else 1.0
        assert opt.step()[:2] == opt2.step()[:2]
    assert opt.get_loss_scale().item() == opt2.get_loss_scale().item() == 2.0**11
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)


# ---------------------------------------------------------------------------- low-precision params
def test_bf16_params_keep_fp32_main_params():
    model = tiny().to(torch.bfloat16)
    ref_model = tiny()  # fp32 reference, same init
    with torch.no_grad():
        for p, q in zip(ref_model.parameters(), model.parameters()):
            p.copy_(q.float())
    opt = get_megatron_optimizer(opt_config(lr=1e-4, bf16=True), [model])
    ref = torch.optim.AdamW(_reference_groups(ref_model, 0.1), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, foreach=True)
    assert all(p.dtype == torch.float32 for p in opt.get_parameters())
    for step in range(3):
        fill_grads(model, step)
        for p, q in zip(ref_model.parameters(), model.parameters()):
            p.grad = None if q.grad is None else q.grad.float()
        assert opt.step()[0]
        ref.step()
    main = {id(m): mp_ for g16, gm in zip(opt.float16_groups, opt.fp32_from_float16_groups) for m, mp_ in zip(g16, gm)}
    for p, q in zip(model.parameters(), ref_model.parameters()):
        if not p.requires_grad:
            continue
        torch.testing.assert_close(main[id(p)], q, rtol=1e-6, atol=1e-7)  # fp32 main follows fp32 AdamW
        assert torch.equal(p, main[id(p)].to(torch.bfloat16))  # model params are the rounded main params
    # Updates of 1e-4 are below bf16 resolution for most weights: the main params keep them.
    assert not torch.equal(main[id(model.linear.weight)].to(torch.bfloat16).float(), main[id(model.linear.weight)])

    sd = copy.deepcopy(opt.state_dict())
    model2 = copy.deepcopy(model)
    opt2 = get_megatron_optimizer(opt_config(lr=1e-4, bf16=True), [model2])
    opt2.load_state_dict(sd)
    for a, b in zip(opt.get_parameters(), opt2.get_parameters()):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------- config errors
def test_config_errors():
    with pytest.raises(ConfigError, match="optimizer.optimizer='lion'"):
        get_megatron_optimizer(opt_config(optimizer="lion"), [tiny()])
    with pytest.raises(NotSupportedError, match="optimizer_cpu_offload"):
        get_megatron_optimizer(opt_config(optimizer_cpu_offload=True, use_precision_aware_optimizer=True), [tiny()])
    with pytest.raises(ConfigError, match="optimizer.lr"):
        get_megatron_optimizer(opt_config(lr=None), [tiny()])


# ---------------------------------------------------------------------------- DTensor grad norm (2 processes)
def _dtensor_task() -> dict:
    """On each of 2 ranks (the shared worker pool; it tears the process group down after the task)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    init_gloo()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    g = torch.Generator().manual_seed(0)
    full_w, full_b = torch.randn(6, 4, generator=g), torch.randn(6, generator=g)
    full_gw, full_gb = torch.randn(6, 4, generator=g) * 3, torch.randn(6, generator=g)
    full_gw[0] = 0.0  # 4 zeros, all in rank 0's shard
    plain_g = torch.randn(5, generator=g)

    module = nn.Module()
    module.weight = nn.Parameter(distribute_tensor(full_w, mesh, [Shard(0)]))
    module.bias = nn.Parameter(distribute_tensor(full_b, mesh, [Replicate()]))
    module.extra = nn.Parameter(torch.zeros(5))
    opt = get_megatron_optimizer(opt_config(clip_grad=1.0, log_num_zeros_in_grad=True), [module])
    module.weight.grad = distribute_tensor(full_gw, mesh, [Shard(0)])
    module.bias.grad = distribute_tensor(full_gb, mesh, [Replicate()])
    module.extra.grad = plain_g.clone()
    ok, norm, zeros = opt.step()
    clipped_w = module.weight.grad.full_tensor()

    # fp16 with an inf only in rank 1's shard: every rank must skip.
    opt16 = get_megatron_optimizer(opt_config(fp16=True, initial_loss_scale=4.0, hysteresis=1), [module])
    gw = full_gw.clone()
    gw[5, 0] = float("inf")  # row 5 lives on rank 1
    module.weight.grad = distribute_tensor(gw, mesh, [Shard(0)])
    module.bias.grad = distribute_tensor(full_gb, mesh, [Replicate()])
    module.extra.grad = plain_g.clone()
    skipped = opt16.step()
    return {"ok": ok, "norm": norm, "zeros": zeros, "clipped_w": clipped_w, "skipped": skipped,
            "scale_after": opt16.get_loss_scale().item()}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_dtensor_grad_norm_equals_unsharded_norm():
    """Sharded (Shard(0)) + replicated DTensor grads + a plain grad on a 2-rank gloo mesh."""
    results = get_shared_pool(2).run(_dtensor_task, timeout=120)
    g = torch.Generator().manual_seed(0)
    torch.randn(6, 4, generator=g), torch.randn(6, generator=g)
    full_gw, full_gb = torch.randn(6, 4, generator=g) * 3, torch.randn(6, generator=g)
    full_gw[0] = 0.0
    plain_g = torch.randn(5, generator=g)
    stand_ins = [nn.Parameter(torch.zeros_like(t)) for t in (full_gw, full_gb, plain_g)]
    for s, t in zip(stand_ins, (full_gw, full_gb, plain_g)):
        s.grad = t.clone()
    expected = float(torch.nn.utils.clip_grad_norm_(stand_ins, 1.0))
    for r in results:
        assert r["ok"] is True
        assert r["norm"] == pytest.approx(expected, rel=1e-6)
        assert r["zeros"] == 4
        torch.testing.assert_close(r["clipped_w"], stand_ins[0].grad)
        assert r["skipped"] == (False, None, None)
        assert r["scale_after"] == 2.0  # backed off once (hysteresis 1)


def test_main_params_module_lets_dcp_name_the_fp32_main_state():
    """bf16 params: DCP's get/set_optimizer_state_dict work through main_params_module and resume exactly."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    def build():
        m = tiny().to(torch.bfloat16)
        return m, get_megatron_optimizer(opt_config(lr=1e-3, bf16=True), [m])

    model, opt = build()
    for step in range(2):
        fill_grads(model, step)
        opt.step()
    proxy = opt.main_params_module(model)
    assert [n for n, _ in proxy.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert all(p.dtype == torch.float32 for n, p in proxy.named_parameters() if n != "frozen")
    osd = copy.deepcopy(get_optimizer_state_dict(proxy, opt.optimizer))
    assert "linear.weight" in osd["state"]
    master = copy.deepcopy(proxy.state_dict())

    model2, opt2 = build()
    proxy2 = opt2.main_params_module(model2)
    proxy2.load_state_dict(master)
    set_optimizer_state_dict(proxy2, opt2.optimizer, osd)
    opt2.copy_main_params_to_model_params()
    for step in range(2, 4):
        fill_grads(model, step)
        fill_grads(model2, step)
        opt.step()
        opt2.step()
    for a, b in zip(opt.get_parameters(), opt2.get_parameters()):
        assert torch.equal(a, b)
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)


def test_bf16_param_without_grad_is_not_stepped_with_a_stale_grad():
    model = tiny().to(torch.bfloat16)
    opt = get_megatron_optimizer(opt_config(lr=1e-2, bf16=True), [model])
    fill_grads(model, 0)
    opt.step()
    main_bias = opt.main_params_module(model).norm.bias
    before = main_bias.detach().clone()
    fill_grads(model, 1)
    model.norm.bias.grad = None  # unused this iteration (no zero_grad in between)
    opt.step()
    assert torch.equal(main_bias, before)
    assert torch.equal(model.norm.bias, before.to(torch.bfloat16))


def test_apply_wd_to_qk_layernorm_decays_the_qk_norms_only() -> None:
    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_layernorm, self.k_layernorm = nn.LayerNorm(4), nn.LayerNorm(4)
            self.norm = nn.LayerNorm(4)
            self.linear = nn.Linear(4, 4)

    model = Attention()
    def decayed(**kw) -> set[str]:
        groups = get_param_groups([model], opt_config(**kw))
        return set().union(*(names_in(g, model) for g in groups if g["wd_mult"] == 1.0))

    assert decayed() == {"linear.weight"}
    assert decayed(apply_wd_to_qk_layernorm=True) == {
        "linear.weight", "q_layernorm.weight", "q_layernorm.bias", "k_layernorm.weight", "k_layernorm.bias"}


def _partial_grads_reduced_once() -> dict:
    """Worker task: a replicated parameter used on each rank's sequence shard (a norm weight under sequence
    parallel) has a partial-sum gradient; ``reduce_partial_grads`` reduces two of them in one collective, to
    the sums a per-parameter reduction gives."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from longspan.training.optim.partial_grads import reduce_partial_grads
    from tests.parallel.harness import init_gloo

    init_gloo()
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    weights = [torch.nn.Parameter(DTensor.from_local(torch.randn(n), mesh, [Replicate()])) for n in (5, 3)]
    x = DTensor.from_local(torch.randn(4, 8) + dist.get_rank(), mesh, [Shard(0)])  # this rank's rows
    for w in weights:
        (x[:, :w.shape[0]] * w).sum().backward()
    want = [w.grad.full_tensor() for w in weights]  # the per-parameter reduction
    assert all(w.grad.placements[0].is_partial() for w in weights)
    collectives = reduce_partial_grads(weights)
    return {"collectives": collectives, "placements": [str(w.grad.placements) for w in weights],
            "equal": all(torch.equal(w.grad.to_local(), g) for w, g in zip(weights, want))}


@pytest.mark.slow
def test_partial_sum_gradients_are_reduced_together_to_the_same_sums() -> None:
    for result in get_shared_pool(2).run(_partial_grads_reduced_once):
        assert result == {"collectives": 1, "placements": ["(Replicate(),)", "(Replicate(),)"], "equal": True}
