"""The precision-aware optimizer (megatron-core's ``use_precision_aware_optimizer``, ``main_params_dtype``,
``main_grads_dtype``, ``exp_avg_dtype``, ``exp_avg_sq_dtype``): longspan.training.optim.precision_aware_adam.

- with every dtype fp32 it is torch's AdamW / Adam bit for bit (the oracle: ``torch.optim``);
- bf16/fp16 moments are stored in that dtype and the parameters stay close to the fp32 reference;
- its state dict round trip (torch's save/load casts floating state to the parameter's dtype) keeps the
  moments' dtype and resumes bit for bit; so does a checkpointed ``pretrain`` run with dropout on;
- through ``get_megatron_optimizer`` main params live in ``main_params_dtype`` and main grads in
  ``main_grads_dtype``; the gradient norm of bf16 grads is accumulated in fp32;
- Megatron's validity rules are one-line ConfigErrors (uint8/fp8 moments: NotSupportedError);
- two ranks under the distributed optimizer (FSDP2 shards) train like one process.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from torch import nn

from longspan.config.schema.optim import OptimizerConfig
from longspan.core.errors import ConfigError, NotSupportedError
from longspan.training.step.forward_step import forward_step
from longspan.training.optim.optimizer import get_megatron_optimizer
from longspan.training.optim.precision_aware_adam import PrecisionAwareAdamW
from longspan.training.pretrain import pretrain
from tests.training.pretrain_helpers import (
    losses_by_iteration,
    small_config,
    with_dropout_and_real_data,
    write_token_corpus,
)

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def _train(make_optimizer, steps: int = 20, seed: int = 0, dtype: torch.dtype = FP32, grad_scale: float = 1.0):
    """Three parameters stepped ``steps`` times with the same random gradients; (params, optimizer)."""
    torch.manual_seed(seed)
    params = [nn.Parameter(torch.randn(shape).to(dtype)) for shape in ((33, 17), (17,), (5, 4, 3))]
    optimizer = make_optimizer(params)
    gen = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        for p in params:
            p.grad = (torch.randn(p.shape, generator=gen) * grad_scale).to(dtype)
        optimizer.step()
    return params, optimizer


@pytest.mark.parametrize("decoupled", [True, False])
def test_fp32_dtypes_are_torch_adam_bit_for_bit(decoupled: bool) -> None:
    torch_cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    kwargs = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    want, _ = _train(lambda p: torch_cls(p, foreach=False, **kwargs))
    got, opt = _train(lambda p: PrecisionAwareAdamW(p, decoupled_weight_decay=decoupled, **kwargs))
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert {s["exp_avg"].dtype for s in opt.state.values()} == {FP32}


@pytest.mark.parametrize("exp_avg_dtype, exp_avg_sq_dtype", [(BF16, BF16), (FP16, FP32), (FP32, BF16)])
def test_low_precision_moments_are_stored_low_and_stay_close(exp_avg_dtype, exp_avg_sq_dtype) -> None:
    want, _ = _train(lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1))
    got, opt = _train(lambda p: PrecisionAwareAdamW(p, lr=1e-2, weight_decay=0.1, exp_avg_dtype=exp_avg_dtype,
                                                    exp_avg_sq_dtype=exp_avg_sq_dtype))
    for state in opt.state.values():
        assert (state["exp_avg"].dtype, state["exp_avg_sq"].dtype) == (exp_avg_dtype, exp_avg_sq_dtype)
    diff = max(float((g - w).detach().abs().max()) for g, w in zip(got, want))
    # 20 steps of at most lr (1e-2) each move a weight up to 0.2; rounding the moments moves it ~1e-3 of that.
    assert 0.0 < diff < 2e-3


def _state_bytes(optimizer) -> bytes:
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    return buffer.getvalue()


@pytest.mark.parametrize("param_dtype, exp_avg_dtype, exp_avg_sq_dtype", [(FP32, BF16, FP16), (FP16, BF16, BF16)])
def test_state_dict_round_trip_keeps_dtypes_and_resumes_bit_for_bit(param_dtype, exp_avg_dtype,
                                                                    exp_avg_sq_dtype) -> None:
    """fp16 params with bf16 moments of tiny gradients: torch's load would pass them through fp16 (its
    param-dtype cast), flushing the second moment (~1e-10) to zero."""
    make = lambda p: PrecisionAwareAdamW(p, lr=1e-2, weight_decay=0.1, exp_avg_dtype=exp_avg_dtype,  # noqa: E731
                                         exp_avg_sq_dtype=exp_avg_sq_dtype)
    params, opt = _train(make, steps=5, dtype=param_dtype, grad_scale=1e-5)
    saved_params = [p.detach().clone() for p in params]
    saved_state = _state_bytes(opt)

    def continue_training(params, opt):
        gen = torch.Generator().manual_seed(99)
        for _ in range(5):
            for p in params:
                p.grad = (torch.randn(p.shape, generator=gen) * 1e-5).to(param_dtype)
            opt.step()
        return [p.detach().clone() for p in params]

    straight = continue_training(params, opt)
    resumed_params = [nn.Parameter(p.clone()) for p in saved_params]
    resumed_opt = make(resumed_params)
    resumed_opt.load_state_dict(torch.load(io.BytesIO(saved_state), weights_only=True))
    assert {(s["exp_avg"].dtype, s["exp_avg_sq"].dtype) for s in resumed_opt.state.values()} == {
        (exp_avg_dtype, exp_avg_sq_dtype)}
    saved = torch.load(io.BytesIO(saved_state), weights_only=True)["state"]
    for index, param in enumerate(resumed_params):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(resumed_opt.state[param][key], saved[index][key])
    resumed = continue_training(resumed_params, resumed_opt)
    assert all(torch.equal(a, b) for a, b in zip(straight, resumed))


# ------------------------------------------------------------------------------ through get_megatron_optimizer
def _opt_config(**fields) -> OptimizerConfig:
    """The OptimizerConfig these tests start from, with ``fields`` on top."""
    return OptimizerConfig(**{"lr": 1e-2, "min_lr": 0.0, "weight_decay": 0.1, "clip_grad": 0.0, "adam_beta1": 0.9,
                              "adam_beta2": 0.95, "adam_eps": 1e-8, **fields})


def _model(dtype=FP32) -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)).to(dtype)


def _step_model(model: nn.Module, optimizer, steps: int = 4) -> list[float]:
    gen = torch.Generator().manual_seed(5)
    norms = []
    for _ in range(steps):
        optimizer.zero_grad()
        x = torch.randn(6, 8, generator=gen).to(next(model.parameters()).dtype)
        model(x).float().pow(2).mean().backward()
        _, norm, _ = optimizer.step()
        norms.append(norm)
    return norms


def test_precision_aware_with_fp32_dtypes_matches_the_plain_optimizer() -> None:
    plain, aware = _model(), _model()
    norms_plain = _step_model(plain, get_megatron_optimizer(_opt_config(), [plain]))
    aware_opt = get_megatron_optimizer(_opt_config(use_precision_aware_optimizer=True), [aware])
    assert isinstance(aware_opt.optimizer, PrecisionAwareAdamW)
    norms_aware = _step_model(aware, aware_opt)
    assert norms_aware == pytest.approx(norms_plain, rel=1e-6)
    # The plain path may use torch's fused AdamW kernel, which rounds differently in the last bit (the
    # bit-for-bit comparison is against torch's single-tensor AdamW above).
    for a, b in zip(aware.parameters(), plain.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_main_params_and_main_grads_live_in_their_dtypes() -> None:
    model = _model(BF16)
    config = _opt_config(bf16=True, use_precision_aware_optimizer=True, main_params_dtype=FP16,
                     main_grads_dtype=BF16, exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16)
    opt = get_megatron_optimizer(config, [model])
    pairs = [pair for f16, main in zip(opt.float16_groups, opt.fp32_from_float16_groups) for pair in zip(f16, main)]
    assert len(pairs) == 4 and {main.dtype for _, main in pairs} == {FP16}
    before = [p.detach().clone() for p in model.parameters()]

    model(torch.randn(6, 8).to(BF16)).float().pow(2).mean().backward()
    model_grads = {id(p): p.grad.clone() for p in model.parameters()}
    assert not opt.prepare_grads()
    for model_param, main in pairs:
        assert main.grad is None and main.decoupled_grad.dtype == BF16
        assert torch.equal(main.decoupled_grad, model_grads[id(model_param)])
    # The norm of bf16 gradients, accumulated in fp32.
    want = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in model_grads.values()]))
    assert opt.get_grad_norm() == pytest.approx(float(want), rel=1e-6)
    opt.step_with_ready_grads()
    moments = list(opt.optimizer.state.values())
    assert {(s["exp_avg"].dtype, s["exp_avg_sq"].dtype) for s in moments} == {(BF16, BF16)}
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    # The model's bf16 weights are the updated fp16 main weights, rounded.
    assert all(torch.equal(model_param, main.to(BF16)) for model_param, main in pairs)
    opt.zero_grad()
    assert all(getattr(main, "decoupled_grad", None) is None for _, main in pairs)


def test_fp32_main_grads_are_cast_once() -> None:
    model = _model(BF16)
    opt = get_megatron_optimizer(_opt_config(bf16=True, use_precision_aware_optimizer=True), [model])
    model(torch.randn(6, 8).to(BF16)).float().pow(2).mean().backward()
    opt.prepare_grads()
    main_params = [p for group in opt.fp32_from_float16_groups for p in group]
    assert {p.dtype for p in main_params} == {FP32}
    assert {p.decoupled_grad.dtype for p in main_params} == {FP32}


# ------------------------------------------------------------------------------------------ validity rules
def _validate(tmp_path: Path, **fields) -> None:
    cfg = small_config(tmp_path, train_iters=2)
    for dotted, value in fields.items():
        section, name = dotted.split("__")
        setattr(getattr(cfg, section), name, value)
    cfg.validate(world_size=1)


AWARE = {"optimizer__use_precision_aware_optimizer": True, "optimizer__use_distributed_optimizer": True}


@pytest.mark.parametrize("fields, error, start", [
    ({"optimizer__exp_avg_dtype": BF16}, ConfigError,
     "optimizer.exp_avg_dtype=torch.bfloat16 needs optimizer.use_precision_aware_optimizer=True"),
    ({"optimizer__use_precision_aware_optimizer": True}, ConfigError,
     "optimizer.use_precision_aware_optimizer=True needs the distributed optimizer"),
    ({**AWARE, "optimizer__optimizer": "sgd"}, ConfigError,
     "optimizer.use_precision_aware_optimizer=True works with optimizer='adam' only"),
    ({**AWARE, "optimizer__exp_avg_sq_dtype": torch.uint8}, NotSupportedError,
     "optimizer.exp_avg_sq_dtype=torch.uint8 (fp8 moments, TransformerEngine only) is not supported yet"),
    ({**AWARE, "optimizer__main_params_dtype": BF16}, ConfigError,
     "optimizer.main_params_dtype=torch.bfloat16 is invalid: use one of torch.float32, torch.float16"),
    ({**AWARE, "optimizer__main_grads_dtype": FP16}, ConfigError,
     "optimizer.main_grads_dtype=torch.float16 is invalid: use one of torch.float32, torch.bfloat16"),
    ({**AWARE, "optimizer__main_params_dtype": FP16}, ConfigError,
     "optimizer.main_params_dtype=torch.float16 sets the dtype of the main copies"),
    ({**AWARE, "optimizer__main_grads_dtype": BF16}, ConfigError,
     "optimizer.main_grads_dtype=torch.bfloat16 keeps the bf16 model's gradients in bf16"),
    ({**AWARE, "mixed_precision": "bf16_mixed", "optimizer__main_grads_dtype": BF16}, ConfigError,
     "optimizer.main_grads_dtype=torch.bfloat16 with ddp.grad_reduce_in_fp32=True"),
])
def test_megatron_rules_are_one_line_errors(tmp_path: Path, fields, error, start) -> None:
    fields = dict(fields)
    cfg = small_config(tmp_path, train_iters=2)
    if "mixed_precision" in fields:
        cfg.mixed_precision = fields.pop("mixed_precision")
    for dotted, value in fields.items():
        section, name = dotted.split("__")
        setattr(getattr(cfg, section), name, value)
    with pytest.raises(error) as err:
        cfg.validate(world_size=1)
    assert str(err.value).startswith(start) and "\n" not in str(err.value)


def test_valid_settings_pass(tmp_path: Path) -> None:
    _validate(tmp_path, **AWARE, optimizer__exp_avg_dtype=BF16, optimizer__exp_avg_sq_dtype=FP16)
    _validate(tmp_path, optimizer__use_precision_aware_optimizer=True, dist__use_torch_fsdp2=True)


# ------------------------------------------------------------------------------- the trainer, one process
@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_token_corpus(tmp_path_factory.mktemp("corpus"))


def _aware_run(tmp_path: Path, name: str, corpus: str, **train_overrides):
    cfg = with_dropout_and_real_data(small_config(tmp_path, name, train_iters=8, eval_interval=100,
                                                  **train_overrides), corpus)
    cfg.mixed_precision = "bf16_mixed"
    cfg.optimizer.use_precision_aware_optimizer = True
    cfg.optimizer.use_distributed_optimizer = True
    cfg.optimizer.main_params_dtype = FP16
    cfg.optimizer.exp_avg_dtype = BF16
    cfg.optimizer.exp_avg_sq_dtype = BF16
    return cfg


def test_pretrain_resumes_bit_for_bit_with_low_precision_state(tmp_path: Path, corpus: str) -> None:
    straight = _aware_run(tmp_path, "straight", corpus)
    pretrain(straight, forward_step)
    reference = losses_by_iteration(straight)
    assert sorted(reference) == list(range(1, 9))

    first = _aware_run(tmp_path, "resumed", corpus, exit_interval=4)
    pretrain(first, forward_step)
    second = _aware_run(tmp_path, "resumed", corpus)
    pretrain(second, forward_step)
    resumed = losses_by_iteration(second)
    assert [resumed[i] for i in range(1, 9)] == [reference[i] for i in range(1, 9)]


# ------------------------------------------------------------ the trainer, two ranks (distributed optimizer)
def _two_rank_run(run_dir: str, iters: int, exit_interval: int | None = None) -> None:
    """Worker task: pretrain the tiny recipe under dp2 + distributed optimizer, bf16 with fp16 main params and
    bf16 moments, dropout on, checkpoints in ``run_dir``."""
    import torch

    from longspan.training.pretrain import pretrain
    from tests.parallel.test_layout_parity import pretrain_config

    cfg = pretrain_config(run_dir, iters=iters, dist_opt=True)
    cfg.model.hidden_dropout = cfg.model.attention_dropout = 0.1
    cfg.mixed_precision = "bf16_mixed"
    cfg.optimizer.use_precision_aware_optimizer = True
    cfg.optimizer.main_params_dtype = torch.float16
    cfg.optimizer.exp_avg_dtype = cfg.optimizer.exp_avg_sq_dtype = torch.bfloat16
    cfg.checkpoint.save = cfg.checkpoint.load = f"{run_dir}/ckpt"
    cfg.train.exit_interval = exit_interval
    pretrain(cfg)


@pytest.mark.slow
def test_two_rank_distributed_optimizer_resumes_bit_for_bit(pool2, tmp_path: Path) -> None:
    from tests.helpers.layout_parity import logged

    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    pool2.run(_two_rank_run, straight, 6)
    pool2.run(_two_rank_run, resumed, 6, exit_interval=3)
    pool2.run(_two_rank_run, resumed, 6)
    want, got = logged(straight), logged(resumed)
    assert want["iterations"] == list(range(1, 7))
    # The first leg logged iterations 1-3, the second resumed at 4 (a restart from scratch would log 1-6 again).
    assert got["iterations"] == want["iterations"]
    assert got["losses"] == want["losses"] and got["norms"] == want["norms"]


def test_planner_counts_the_precision_aware_state(tmp_path: Path) -> None:
    """``longspan plan`` sizes main params and moments by their dtypes: bf16 moments halve the optimizer state,
    fp16 main params halve the main copies."""
    from longspan.planner.plan import Layout, estimate_memory

    def memory(**optimizer_fields):
        cfg = small_config(tmp_path, train_iters=2)
        cfg.mixed_precision = "bf16_mixed"
        cfg.model.vocab_size = 256
        for name, value in optimizer_fields.items():
            setattr(cfg.optimizer, name, value)
        cfg.validate(world_size=1)
        return estimate_memory(cfg, Layout(world_size=1))

    plain = memory()
    aware = memory(**{k.split("__")[1]: v for k, v in AWARE.items()}, exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16,
                   main_params_dtype=FP16)
    assert aware.optimizer == pytest.approx(plain.optimizer / 2)
    params = plain.optimizer / 8  # Adam: two fp32 moments per parameter
    assert plain.weights - aware.weights == pytest.approx(params * 2)  # fp32 -> fp16 main copies
