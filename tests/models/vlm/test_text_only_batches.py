"""A training batch without images still runs a vision-language model's encoder (on a blank image, times 0), so
every data-parallel rank reduces the same gradients: the outputs stay those of evaluation, every encoder and
projector parameter gets a zero gradient; with the encoder frozen (or in evaluation) it is not run at all.
(The layouts with such batches: tests/data/sft_vlm/test_gemma_vlm_finetune.py.)"""

from __future__ import annotations

import pytest
import torch


def _provider(family: str, tmp_path):
    if family == "qwen":
        from longspan.families.qwen_vl.recipes import _placeholder_model

        return _placeholder_model()
    from longspan import AutoBridge
    from tests.conversion.gemma_vlm_models import make_gemma3_vlm

    make_gemma3_vlm(tmp_path)
    return AutoBridge.from_hf_pretrained(tmp_path).to_megatron_provider(load_weights=False)


@pytest.mark.parametrize("family", ["qwen", "gemma"])
def test_a_training_batch_without_images_gives_the_vision_parts_zero_gradients(family, tmp_path):
    provider = _provider(family, tmp_path)
    provider.hidden_dropout = provider.attention_dropout = 0.0
    model = provider.provide()
    tokens = torch.randint(10, 90, (2, 8), generator=torch.Generator().manual_seed(0))  # no image token
    want = model.eval()(tokens).detach()
    got = model.train()(tokens)
    assert torch.equal(got, want)
    got.float().square().mean().backward()
    vision = {n: p for n, p in model.named_parameters() if not n.startswith("language_model.")}
    assert vision and all(p.grad is not None and not p.grad.any() for p in vision.values()), \
        [n for n, p in vision.items() if p.grad is None or p.grad.any()]

    provider.freeze_vision_model = provider.freeze_vision_projection = True
    frozen = provider.provide().train()
    frozen(tokens).float().sum().backward()
    assert all(p.grad is None for n, p in frozen.named_parameters() if not n.startswith("language_model."))
