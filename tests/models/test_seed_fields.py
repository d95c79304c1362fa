"""The TransformerConfig seed fields apply_residual_connection_post_layernorm, fp32_residual_connection and
attention_softmax_in_fp32 (rotary_interleaved: tests/conversion/test_rope_scalings.py) do what their docstrings
say: each layer is checked against its formula written out by hand."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from longspan.core.errors import NotSupportedError
from longspan.models.gpt import build_gpt_model
from longspan.models.transformer import low_precision_softmax_attention
from longspan.parallel.pipeline import activation_spec
from tests.models.gpt_test_config import llama_config

NO_DROPOUT = dict(hidden_dropout=0.0, attention_dropout=0.0)


def _layer_and_input(dtype: torch.dtype = torch.float32, **fields):
    model = build_gpt_model(llama_config(**NO_DROPOUT, params_dtype=dtype, **fields), seed=2).eval()
    x = torch.randn(2, 10, 64, generator=torch.Generator().manual_seed(0)).to(dtype)
    return model, model.decoder.layers["0"], x


def test_residual_post_layernorm_adds_to_the_normalized_input():
    _, layer, x = _layer_and_input(apply_residual_connection_post_layernorm=True)
    with torch.no_grad():
        n1 = layer.input_layernorm(x)
        h = n1 + layer.self_attention(n1)
        n2 = layer.pre_mlp_layernorm(h)
        expected = n2 + layer.mlp(n2)
        assert torch.equal(layer(x), expected)
        pre_norm = h_default = x + layer.self_attention(n1)
        h_default = h_default + layer.mlp(layer.pre_mlp_layernorm(pre_norm))
        assert not torch.allclose(expected, h_default, atol=1e-3)


def test_fp32_residual_keeps_the_stream_in_float32():
    model, layer, x = _layer_and_input(torch.bfloat16, fp32_residual_connection=True)
    with torch.no_grad():
        h = x.float()
        n1 = layer.input_layernorm(h).to(torch.bfloat16)
        h = h + layer.self_attention(n1)
        n2 = layer.pre_mlp_layernorm(h).to(torch.bfloat16)
        expected = h + layer.mlp(n2)
        out = layer(x.float())
        assert out.dtype == torch.float32 and torch.equal(out, expected)
        seen = []
        for block_layer in model.decoder.layers.values():
            block_layer.register_forward_hook(lambda m, i, o: seen.append((i[0].dtype, o.dtype)))
        tokens = torch.randint(0, 100, (2, 10))
        logits = model(tokens)
        assert seen == [(torch.float32, torch.float32)] * 2 and logits.dtype == torch.bfloat16
        plain = build_gpt_model(llama_config(**NO_DROPOUT, params_dtype=torch.bfloat16), seed=2).eval()
        assert not torch.equal(plain(tokens), logits)
    # a float32 model: nothing to change
    a, b = (build_gpt_model(llama_config(**NO_DROPOUT, fp32_residual_connection=f), seed=2).eval() for f in (0, 1))
    with torch.no_grad():
        assert torch.equal(a(tokens), b(tokens))


def test_fp32_residual_layernorm_model_and_pipeline_dtype():
    model = build_gpt_model(llama_config(**NO_DROPOUT, params_dtype=torch.bfloat16, normalization="LayerNorm",
                                         fp32_residual_connection=True), seed=2).eval()
    with torch.no_grad():
        assert model(torch.randint(0, 100, (1, 6))).dtype == torch.bfloat16
    cfg = SimpleNamespace(model=llama_config(params_dtype=torch.bfloat16, fp32_residual_connection=True),
                          train=SimpleNamespace(micro_batch_size=2))
    assert activation_spec(cfg)[1] == torch.float32


def _bf16_attention_by_hand(q, k, v, scale):
    n_rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    scores = (q @ k.transpose(-2, -1)) * scale
    causal = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).triu(1)
    probs = scores.masked_fill(causal, torch.finfo(scores.dtype).min).softmax(-1)
    assert probs.dtype == torch.bfloat16
    return probs @ v


def test_softmax_in_low_precision_when_asked():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, h, 12, 16, generator=g).to(torch.bfloat16) for h in (4, 2, 2))
    scale = 1 / math.sqrt(16)
    low = low_precision_softmax_attention(q, k, v, None, 0.0, scale)
    assert torch.equal(low, _bf16_attention_by_hand(q, k, v, scale))
    fused = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    assert not torch.equal(low, fused)
    # through the model: bf16 differs, float32 is the same maths
    tokens = torch.randint(0, 100, (2, 12))
    for dtype, same in ((torch.bfloat16, False), (torch.float32, True)):
        a, b = (build_gpt_model(llama_config(**NO_DROPOUT, params_dtype=dtype, attention_softmax_in_fp32=f),
                                seed=2).eval() for f in (True, False))
        with torch.no_grad():
            assert torch.equal(a(tokens), b(tokens)) == same, dtype


def test_softmax_in_low_precision_refuses_context_parallel():
    with pytest.raises(NotSupportedError, match="attention_softmax_in_fp32=False"):
        build_gpt_model(llama_config(attention_softmax_in_fp32=False, context_parallel_size=2))
