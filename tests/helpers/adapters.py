"""Adapters as after training, for tests that need every adapter to change the output."""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn


def perturb_adapters(model: nn.Module, std: float = 0.1, seed: int = 1) -> None:
    """Add normal noise (``std``) to every adapter's B and DoRA magnitude: B starts at zero and a magnitude at
    its row norms, where an adapter changes nothing."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_out.weight") or name.endswith("weight_magnitude"):
                p.add_(torch.randn(p.shape, generator=g) * std)


def trained_parameters(model: nn.Module, ids: torch.Tensor) -> dict[str, nn.Parameter]:
    """One backward of ``model``'s mean next-token loss on ``ids`` (adapters perturbed first): the parameters that
    require gradients, each checked to have a non-zero one, and every frozen one checked to have none."""
    perturb_adapters(model)
    model(ids, labels=torch.roll(ids, -1, 1)).float().mean().backward()
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(p.grad is not None and p.grad.abs().sum() > 0 for p in trainable.values())
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    return trainable


@torch.no_grad()
def assert_adapters_act_and_fold(model: nn.Module, base: nn.Module, fresh_base: nn.Module, ids: torch.Tensor,
                                 each_reaches: Iterable[nn.Module]) -> None:
    """``model`` (adapters as initialized, eval mode) equals ``base``; once perturbed its output moves, a
    ``fresh_base`` loaded with the merged weights gives it, every layer of ``each_reaches`` moves it on its own
    (a forward that skipped one would pass the rest only if its merged weight were skipped too), and merging
    in place keeps it."""
    from longspan.peft.adapters import merge_adapters, merged_state_dict
    from longspan.peft.modules import LoRALinear

    assert torch.equal(model(ids), base(ids))  # B = 0 (and DoRA's magnitudes = the row norms): the base
    perturb_adapters(model)
    adapted = model(ids)
    assert (adapted - base(ids)).abs().max() > 1e-3
    fresh_base.load_state_dict(merged_state_dict(model))
    torch.testing.assert_close(fresh_base(ids), adapted, atol=2e-5, rtol=1e-5)
    for layer in each_reaches:
        saved = layer.adapter.linear_out.weight.clone()
        layer.adapter.linear_out.weight.zero_()
        assert (model(ids) - adapted).abs().max() > 1e-6, layer
        layer.adapter.linear_out.weight.copy_(saved)
    merge_adapters(model)
    assert not any(isinstance(m, LoRALinear) for m in model.modules())
    torch.testing.assert_close(model(ids), adapted, atol=2e-5, rtol=1e-5)
