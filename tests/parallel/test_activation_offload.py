"""model.cpu_offloading: the first layers' saved tensors go through the host and the maths stays bit-identical."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from longspan.core.errors import ConfigError, NotSupportedError
from longspan.models.gpt import build_gpt_model
from longspan.parallel.offload import apply_activation_offload
from tests.training.pretrain_helpers import small_config


def _tiny(tmp_path: Path, **model):
    cfg = small_config(tmp_path)
    cfg.model.vocab_size, cfg.model.hidden_size, cfg.model.ffn_hidden_size = 256, 32, 64
    cfg.model.hidden_dropout = cfg.model.attention_dropout = 0.0
    for key, value in model.items():
        setattr(cfg.model, key, value)
    return cfg


def _loss_and_grads(model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    loss = model(tokens, labels=tokens).float().mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_offloaded_layers_give_bit_identical_losses_and_gradients(tmp_path: Path) -> None:
    base = _tiny(tmp_path)
    ref_loss, ref_grads = _loss_and_grads(build_gpt_model(base.model, seed=1, device="cpu"))
    counts = {}
    for activations, weights in ((True, False), (False, True), (True, True)):
        cfg = _tiny(tmp_path, cpu_offloading=True, cpu_offloading_num_layers=1,
                    cpu_offloading_activations=activations, cpu_offloading_weights=weights)
        model = build_gpt_model(cfg.model, seed=1, device="cpu")
        handlers = apply_activation_offload([model], cfg.model)
        assert [h.layer for h in handlers] == [model.decoder.layers["0"]]  # the first layer only
        loss, grads = _loss_and_grads(model)
        assert torch.equal(loss, ref_loss) and grads.keys() == ref_grads.keys()
        assert all(torch.equal(grads[n], ref_grads[n]) for n in grads)
        counts[(activations, weights)] = handlers[0].offloaded
    assert counts[(True, False)] > 0 and counts[(False, True)] > 0  # the hooks ran, for both kinds
    assert counts[(True, True)] == counts[(True, False)] + counts[(False, True)]
    with torch.no_grad():  # nothing is saved without autograd: nothing moves
        model(torch.zeros(1, 4, dtype=torch.long))
    assert handlers[0].offloaded == counts[(True, True)]


def test_pretrain_with_offload_trains_the_same_losses(tmp_path: Path) -> None:
    from longspan.training.pretrain import pretrain
    from tests.training.pretrain_helpers import losses_by_iteration

    runs = []
    for name, offload in (("plain", False), ("offload", True)):
        cfg = _tiny(tmp_path / name, cpu_offloading=offload, cpu_offloading_num_layers=1)
        cfg.train.train_iters, cfg.train.eval_interval, cfg.checkpoint.save = 3, None, None
        cfg.scheduler.lr_warmup_iters = 1
        state = pretrain(cfg)
        runs.append((losses_by_iteration(cfg), [h.offloaded for h in getattr(state, "activation_offload", [])]))
    (plain, no_handlers), (offloaded, counts) = runs
    assert no_handlers == [] and len(counts) == 1 and counts[0] > 0  # the first layer's hooks ran every step
    assert offloaded == plain and len(plain) == 3  # bit for bit


@pytest.mark.parametrize("change,error,fragment", [
    ({"model.cpu_offloading_num_layers": 2}, ConfigError, "cpu_offloading_num_layers=2 must be at least 0 and below"),
    ({"model.cpu_offloading_activations": False}, ConfigError, "offloads nothing"),
    ({"model.recompute_granularity": "selective"}, ConfigError, "offload and recompute both manage"),
    ({"train.torch_compile": True}, NotSupportedError, "with train.torch_compile=True is not supported yet"),
])
def test_offload_settings_are_checked(tmp_path: Path, change, error, fragment) -> None:
    cfg = _tiny(tmp_path, cpu_offloading=True, cpu_offloading_num_layers=1)
    for dotted, value in change.items():
        section, name = dotted.split(".")
        setattr(getattr(cfg, section), name, value)
    with pytest.raises(error, match=fragment):
        cfg.validate(world_size=1)


def test_the_first_layers_of_t5_and_mamba_stacks_are_the_ones_offloaded() -> None:
    from types import SimpleNamespace as NS

    from longspan.models import MambaProvider, T5ModelProvider
    from longspan.models.builder import build_meta_model

    t5 = build_meta_model(T5ModelProvider(num_layers=2, encoder_num_layers=2, hidden_size=16, num_attention_heads=2,
                                          vocab_size=64, seq_length=8))
    mamba = build_meta_model(MambaProvider(hidden_size=16, num_layers=3, num_attention_heads=2, vocab_size=64,
                                           seq_length=8, mamba_num_groups=1, mamba_head_dim=8, hybrid_override_pattern="M*M"))
    settings = NS(cpu_offloading=True, cpu_offloading_num_layers=3, cpu_offloading_activations=True,
                  cpu_offloading_weights=False)
    t5_layers = [h.layer for h in apply_activation_offload([t5], settings)]
    assert t5_layers == [*t5.encoder.layers.values(), t5.decoder.layers["0"]]  # encoder first, then decoder
    settings.cpu_offloading_num_layers = 2
    mamba_layers = [h.layer for h in apply_activation_offload([mamba], settings)]
    assert mamba_layers == list(mamba.decoder.layers.values())[:2]
