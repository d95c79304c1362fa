"""longspan.inference.generate on Mamba and hybrid models: the recurrent (cached) path equals full re-runs."""

from __future__ import annotations

import pytest
import torch

from longspan.data.tokenizers import NullTokenizer
from longspan.inference.text_generation import generate
from longspan.models.mamba import build_mamba_model
from tests.models.mamba.mamba_test_config import hybrid_config, mamba_config


@pytest.mark.parametrize("make", [mamba_config, hybrid_config])
def test_cached_generation_equals_uncached(make) -> None:
    model = build_mamba_model(make(vocab_size=128), seed=9)
    tokenizer = NullTokenizer(127)
    prompt = [5, 17, 3, 99, 42, 8, 61]
    cached = generate(model, tokenizer, prompt, max_new_tokens=12, use_cache=True, return_logits=True)
    full = generate(model, tokenizer, prompt, max_new_tokens=12, use_cache=False, return_logits=True)
    assert cached.output_ids == full.output_ids
    for a, b in zip(cached.logits, full.logits):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
