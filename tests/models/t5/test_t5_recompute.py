"""T5 activation recompute: the losses and gradients are those without it, and the recomputed blocks run twice.

Each setting is counted where it acts: 'full' re-runs whole layers (``T5Layer.forward`` calls), 'selective'
re-runs only the attention cores (self- and cross-attention), 'uniform' checkpoints chunks of
``recompute_num_layers`` layers and 'block' only the first ``recompute_num_layers`` layers of each stack.
"""

from __future__ import annotations

import pytest
import torch

from longspan.core.errors import NotSupportedError
from longspan.models import T5ModelProvider
from longspan.models.t5 import T5Layer, build_t5_model


def _provider(**kw) -> T5ModelProvider:
    fields = dict(num_layers=2, encoder_num_layers=3, hidden_size=16, num_attention_heads=2, kv_channels=8,
                  ffn_hidden_size=24, vocab_size=40, make_vocab_size_divisible_by=8, seq_length=12, seq_length_dec=8,
                  position_embedding_type="relative", hidden_dropout=0.0, attention_dropout=0.0)
    fields.update(kw)
    provider = T5ModelProvider(**fields)
    provider.finalize()
    return provider


def _loss_grads_and_calls(monkeypatch: pytest.MonkeyPatch, **recompute) -> tuple[torch.Tensor, dict, dict]:
    model = build_t5_model(_provider(**recompute), seed=3)
    calls = {"layer": 0, "core": 0}
    layer_forward = T5Layer.forward

    def counting_layer(self, *args, **kwargs):
        calls["layer"] += 1
        return layer_forward(self, *args, **kwargs)

    def counting_core(core):
        def run(*args):
            calls["core"] += 1
            return core(*args)
        return run

    monkeypatch.setattr(T5Layer, "forward", counting_layer)
    for module in model.modules():
        if hasattr(module, "core_attention"):
            module.core_attention = counting_core(module.core_attention)
    gen = torch.Generator().manual_seed(0)
    enc, dec = torch.randint(0, 40, (2, 12), generator=gen), torch.randint(0, 40, (2, 8), generator=gen)
    pad = torch.zeros(2, 1, 1, 12, dtype=torch.bool)
    pad[0, ..., 9:] = True  # uneven padding
    loss = model(enc, dec, encoder_attn_mask=pad, encoder_decoder_attn_mask=pad,
                 lm_labels=torch.randint(0, 40, (2, 8), generator=gen))
    loss.sum().backward()
    monkeypatch.setattr(T5Layer, "forward", layer_forward)
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, calls


# 5 layers (3 encoder + 2 decoder) and 7 attention cores (3 + 2 self, 2 cross); what each setting re-runs
CASES = {
    "full_uniform_2": (dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
                       5, 0),   # every layer, in chunks [0, 1] [2] and [0, 1]
    "full_block_1": (dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
                     2, 0),     # layer 0 of the encoder and of the decoder
    "selective": (dict(recompute_granularity="selective"), 0, 7),  # every attention core
}


@pytest.mark.parametrize("name", list(CASES))
def test_recompute_keeps_losses_and_gradients_and_reruns_the_recomputed_blocks(name, monkeypatch):
    recompute, extra_layers, extra_cores = CASES[name]
    base_loss, base_grads, base_calls = _loss_grads_and_calls(monkeypatch)
    assert base_calls == {"layer": 5, "core": 7}
    loss, grads, calls = _loss_grads_and_calls(monkeypatch, **recompute)
    torch.testing.assert_close(loss, base_loss, rtol=0, atol=0)
    assert grads.keys() == base_grads.keys()
    for key, grad in grads.items():
        torch.testing.assert_close(grad, base_grads[key], rtol=1e-6, atol=1e-7, msg=key)
    # a recomputed layer re-runs its attention cores too
    cores_per_layer_rerun = {"full_uniform_2": 7, "full_block_1": 1 + 2}[name] if extra_layers else 0
    assert calls == {"layer": 5 + extra_layers, "core": 7 + extra_cores + cores_per_layer_rerun}


def test_selective_recompute_covers_the_attention_core_only():
    with pytest.raises(NotSupportedError, match=r"recompute_modules=\['mlp'\] is not supported"):
        build_t5_model(_provider(recompute_granularity="selective", recompute_modules=["mlp"]), materialize=False)
