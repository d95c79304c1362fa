"""The Gemma / OLMo-2 model features on their own: each changes the output as its field's docstring says."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from longspan.core.errors import ConfigError, NotSupportedError
from longspan.models.gpt import build_gpt_model
from longspan.models.gpt_provider import GPTModelProvider
from longspan.models.transformer import RMSNorm, ZeroCenteredLayerNorm, softcapped_core_attention

TOKENS = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))


def _provider(**fields) -> GPTModelProvider:
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
                vocab_size=64, make_vocab_size_divisible_by=64, normalization="RMSNorm",
                position_embedding_type="rope", gated_linear_unit=True, activation_func=F.silu,
                add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, seq_length=32)
    provider = GPTModelProvider(**{**base, **fields})
    provider.finalize()
    return provider


def _logits(provider: GPTModelProvider, seed: int = 1) -> torch.Tensor:
    with torch.no_grad():
        return build_gpt_model(provider, seed=seed).eval()(TOKENS)


@pytest.mark.parametrize("norm", ["RMSNorm", "LayerNorm"])
def test_zero_centered_gamma_scales_by_one_plus_weight(norm):
    x = torch.randn(3, 8)
    w = torch.randn(8)
    if norm == "RMSNorm":
        centred, plain = RMSNorm(8, zero_centered_gamma=True), RMSNorm(8)
    else:
        centred, plain = ZeroCenteredLayerNorm(8), torch.nn.LayerNorm(8)
    with torch.no_grad():
        centred.weight.copy_(w)
        plain.weight.copy_(1 + w)
    assert torch.allclose(centred(x), plain(x), atol=1e-6)
    assert not torch.allclose(centred(x), RMSNorm(8)(x) if norm == "RMSNorm" else torch.nn.LayerNorm(8)(x))


def test_zero_centered_gamma_changes_the_model_output_and_starts_at_zero():
    plain, centred = build_gpt_model(_provider(), seed=1), build_gpt_model(
        _provider(layernorm_zero_centered_gamma=True), seed=1)
    norm = centred.decoder.layers["0"].input_layernorm
    assert torch.equal(norm.weight, torch.zeros_like(norm.weight))  # gamma = 1 + 0: the same function at init
    with torch.no_grad():
        assert torch.equal(plain(TOKENS), centred(TOKENS))
        for name, p in centred.named_parameters():
            if "layernorm" in name:
                p.fill_(0.5)
                dict(plain.named_parameters())[name].fill_(0.5)
        # stored w means gamma = 1.5 zero-centred, 0.5 otherwise
        assert not torch.allclose(plain(TOKENS), centred(TOKENS))
        for name, p in plain.named_parameters():
            if "layernorm" in name:
                p.fill_(1.5)
        assert torch.allclose(plain(TOKENS), centred(TOKENS), atol=1e-6)


def test_zero_centered_gradient_reaches_the_weight():
    model = build_gpt_model(_provider(layernorm_zero_centered_gamma=True), seed=1)
    model(TOKENS, labels=TOKENS).mean().backward()
    grad = model.decoder.layers["0"].input_layernorm.weight.grad
    assert grad is not None and grad.abs().sum() > 0


def test_norms_after_sublayers_and_olmo2_placement():
    reference = _logits(_provider())
    sandwich = build_gpt_model(_provider(layernorm_after_sublayers=True), seed=1)
    names = {n for n, _ in sandwich.named_parameters()}
    assert {"decoder.layers.0.post_self_attn_layernorm.weight", "decoder.layers.0.post_mlp_layernorm.weight",
            "decoder.layers.0.input_layernorm.weight"} <= names
    with torch.no_grad():
        assert not torch.allclose(sandwich.eval()(TOKENS), reference)
    post_only = build_gpt_model(_provider(layernorm_before_sublayers=False, layernorm_after_sublayers=True), seed=1)
    names = {n for n, _ in post_only.named_parameters()}
    assert "decoder.layers.0.input_layernorm.weight" not in names and "decoder.layers.0.pre_mlp_layernorm.weight" \
        not in names and "decoder.layers.0.post_mlp_layernorm.weight" in names


def test_qk_layernorm_across_heads_normalizes_the_whole_projection():
    per_head = build_gpt_model(_provider(qk_layernorm=True), seed=1).eval()
    across = build_gpt_model(_provider(qk_layernorm=True, qk_layernorm_across_heads=True), seed=1).eval()
    attn = across.decoder.layers["0"].self_attention
    assert attn.q_layernorm.weight.shape == (32,) and attn.k_layernorm.weight.shape == (16,)
    with torch.no_grad():
        assert not torch.allclose(per_head(TOKENS), across(TOKENS))
    with pytest.raises(ConfigError, match="qk_layernorm_across_heads=True needs model.qk_layernorm=True"):
        build_gpt_model(_provider(qk_layernorm_across_heads=True))
    # under tensor parallel the head-sharded norm sums the squares over the ranks: an RMSNorm's statistic only
    with pytest.raises(NotSupportedError, match="normalization='LayerNorm' and tensor_model_parallel_size=2 is not"):
        build_gpt_model(_provider(qk_layernorm=True, qk_layernorm_across_heads=True, normalization="LayerNorm",
                                  tensor_model_parallel_size=2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_scaling_rounds_the_factor_to_the_embedding_dtype(dtype):
    model = build_gpt_model(_provider(apply_embedding_scaling=True, hidden_size=48, num_attention_heads=4,
                                      params_dtype=dtype), seed=1)
    emb = model.embedding
    expected = emb.word_embeddings(TOKENS) * torch.tensor(48**0.5).to(dtype)
    assert torch.equal(emb(TOKENS, None), expected)
    if dtype == torch.bfloat16:  # sqrt(48) = 6.928... is 6.9375 in bfloat16: not the float32 factor
        assert not torch.equal(expected, emb.word_embeddings(TOKENS) * math.sqrt(48))


def test_attention_softcapping_equals_eager_formula_and_changes_the_output():
    q, k, v = (torch.randn(2, 4, 7, 8, generator=torch.Generator().manual_seed(i)) * 3 for i in range(3))
    k2, v2 = k[:, :2], v[:, :2]
    out = softcapped_core_attention(q, k2, v2, None, 0.0, 0.5, softcap=2.0)
    kr, vr = k2.repeat_interleave(2, 1), v2.repeat_interleave(2, 1)
    scores = 2.0 * torch.tanh(q @ kr.transpose(-1, -2) * 0.5 / 2.0)
    scores = scores.masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), float("-inf"))
    assert torch.allclose(out, scores.softmax(-1) @ vr, atol=1e-6)
    assert not torch.allclose(_logits(_provider(attn_logit_softcapping=1.0)), _logits(_provider()))


def test_final_logit_softcapping_bounds_the_logits_and_the_loss_uses_them():
    provider = _provider(final_logit_softcapping=0.5, init_method_std=0.1)
    model = build_gpt_model(provider, seed=1).eval()
    with torch.no_grad():
        logits = model(TOKENS)
        uncapped = build_gpt_model(_provider(init_method_std=0.1), seed=1).eval()(TOKENS)
        assert logits.abs().max() <= 0.5 and uncapped.abs().max() > 0.6
        assert torch.allclose(logits, 0.5 * torch.tanh(uncapped / 0.5), atol=1e-6)
        loss = model(TOKENS, labels=TOKENS)
        expected = F.cross_entropy(logits.flatten(0, 1), TOKENS.flatten(), reduction="none").view(TOKENS.shape)
        assert torch.allclose(loss, expected, atol=1e-6)


def test_local_and_global_rotary_bases():
    windows = dict(window_size=[3, 0], window_attn_skip_freq=[1, 0])
    one_base = _logits(_provider(rotary_base=10000, **windows))
    pair = build_gpt_model(_provider(rotary_base=[10000, 10000], rope_scaling_factor=1.0, **windows), seed=1).eval()
    assert [layer.uses_local_rope for layer in pair.decoder.layers.values()] == [True, False]
    with torch.no_grad():
        assert torch.allclose(pair(TOKENS), one_base, atol=1e-6)  # equal bases, no scaling: the same model
    other_local = _logits(_provider(rotary_base=[500, 10000], rope_scaling_factor=1.0, **windows))
    scaled_global = _logits(_provider(rotary_base=[10000, 10000], rope_scaling_factor=4.0, **windows))
    assert not torch.allclose(other_local, one_base) and not torch.allclose(scaled_global, one_base)
    with pytest.raises(NotSupportedError, match="rope_scaling=True with model.rotary_base"):
        build_gpt_model(_provider(rotary_base=[10000, 10000], rope_scaling=True, **windows))
    # the other scalings act on the single table only: refused beside a pair, not left unapplied
    for scaling in (dict(position_embedding_type="yarn", yarn_rotary_scaling_factor=4.0,
                         yarn_original_max_position_embeddings=8),
                    dict(rope_dynamic_factor=2.0, rope_original_max_position_embeddings=8),
                    dict(rope_longrope_short_factor=[1.0] * 4, rope_longrope_long_factor=[2.0] * 4,
                         rope_original_max_position_embeddings=8)):
        with pytest.raises(NotSupportedError, match=rf"model.{next(iter(scaling))}=.* with model.rotary_base="):
            build_gpt_model(_provider(rotary_base=[10000, 10000], rope_scaling_factor=1.0, **windows, **scaling))
    with pytest.raises(ConfigError, match=r"model.rotary_base=\[1, 2, 3\] is out of range: use a positive number or a"):
        build_gpt_model(_provider(rotary_base=[1, 2, 3]))
