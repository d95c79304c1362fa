"""optimizer.decoupled_lr / decoupled_min_lr: the input embedding and the output layer train at their own
learning rate, scheduled by the same scheduler between their own peak and minimum."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from longspan.core.errors import ConfigError
from longspan.training.config import OptimizerConfig
from longspan.training.optim.optimizer import get_megatron_optimizer
from longspan.training.optim.scheduler import OptimizerParamScheduler


class _Embedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(11, 4)


class _TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = _Embedding()
        self.hidden = nn.Linear(4, 4, bias=False)
        self.output_layer = nn.Linear(4, 11, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.output_layer(self.hidden(self.embedding.word_embeddings(tokens)))


def _optimizer(model: nn.Module, **fields: object):
    cfg = OptimizerConfig(optimizer="sgd", lr=0.1, min_lr=0.01, weight_decay=0.0, sgd_momentum=0.0, **fields)
    optimizer = get_megatron_optimizer(cfg, [model])
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=0.1, min_lr=0.01, lr_warmup_steps=0, lr_decay_steps=10,
        lr_decay_style="linear", start_wd=0.0, end_wd=0.0, wd_incr_steps=10, wd_incr_style="constant",
    )
    return optimizer, scheduler


def _lrs(optimizer) -> dict[bool, float]:
    return {bool(g["is_decoupled_lr"]): g["lr"] for g in optimizer.param_groups}


def test_embedding_and_output_follow_their_own_schedule() -> None:
    torch.manual_seed(0)
    model = _TinyLM()
    optimizer, scheduler = _optimizer(model, decoupled_lr=0.5, decoupled_min_lr=0.05)
    decoupled = next(g for g in optimizer.param_groups if g["is_decoupled_lr"])
    assert {id(p) for p in decoupled["params"]} == {id(model.embedding.word_embeddings.weight),
                                                   id(model.output_layer.weight)}
    assert _lrs(optimizer) == {False: pytest.approx(0.1), True: pytest.approx(0.5)}
    scheduler.step(5)  # half way through the linear decay: each group half way between its peak and its minimum
    assert _lrs(optimizer) == {False: pytest.approx(0.055), True: pytest.approx(0.275)}
    scheduler.step(10)
    assert _lrs(optimizer) == {False: pytest.approx(0.01), True: pytest.approx(0.05)}


def test_one_sgd_step_moves_each_parameter_by_its_groups_rate() -> None:
    torch.manual_seed(0)
    model = _TinyLM()
    optimizer, _ = _optimizer(model, decoupled_lr=0.5)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model(torch.tensor([[1, 2, 3, 4]])).square().mean().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    optimizer.step()
    rates = {"embedding.word_embeddings.weight": 0.5, "output_layer.weight": 0.5, "hidden.weight": 0.1}
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.detach(), before[name] - rates[name] * grads[name], rtol=0, atol=1e-7)


def test_without_decoupled_lr_every_parameter_shares_the_rate() -> None:
    optimizer, _ = _optimizer(_TinyLM())
    assert _lrs(optimizer) == {False: pytest.approx(0.1)}


def test_decoupled_min_lr_without_decoupled_lr_is_one_line() -> None:
    from longspan.config.rules.schedule import compute_scheduler_steps
    from longspan.recipes import get_recipe

    cfg = get_recipe("tiny")
    cfg.optimizer.decoupled_min_lr = 1e-5
    with pytest.raises(ConfigError, match="optimizer.decoupled_min_lr=1e-05 needs optimizer.decoupled_lr"):
        compute_scheduler_steps(cfg)
