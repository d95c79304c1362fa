"""Tied-embedding HF models (Qwen3, Llama 3.2-style, GPT-2) imported into a TP2 layout: one-process logits, and
an export bit-identical to the original checkpoint, without ``lm_head.weight`` (pool2 workers, fp32 CPU)."""

from __future__ import annotations

import pytest
import torch

from tests.conversion.hf_models import VOCAB, make_hf_model
from tests.conversion.test_layouts import _import_forward_export, _one_process, _original

TIED_TP_LAYOUTS = [
    ("qwen3", {"tensor_model_parallel_size": 2}),
    ("llama3", {"tensor_model_parallel_size": 2, "sequence_parallel": True}),
    ("gpt2", {"tensor_model_parallel_size": 2}),  # learned positions, LayerNorm, biases
]


@pytest.mark.parametrize("family,layout", TIED_TP_LAYOUTS,
                         ids=[f"{f}-{'-'.join(f'{k[:2]}{v}' for k, v in l.items())}" for f, l in TIED_TP_LAYOUTS])
def test_tied_model_under_tp_matches_one_process_and_exports_bit_identical(pool2, tmp_path, family, layout):
    hf_dir = tmp_path / "hf"
    make_hf_model(family, hf_dir, tokenizer=False)
    original = _original(hf_dir)
    assert "lm_head.weight" not in original  # a tied HF checkpoint stores the weight once
    tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(4))
    expected, expected_export = _one_process(hf_dir, tokens)
    results = pool2.run(_import_forward_export, str(hf_dir), layout, False, tokens, str(tmp_path / "saved"),
                        timeout=180)
    for logits, exported, params, _ in results:
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)
        assert "DTensor" in params
        assert sorted(exported) == sorted(expected_export) == sorted(original)
        for name, tensor in exported.items():
            assert torch.equal(tensor, original[name]), name
    saved = _original(tmp_path / "saved")
    assert sorted(saved) == sorted(original) and all(torch.equal(saved[k], v) for k, v in original.items())
