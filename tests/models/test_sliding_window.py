"""Sliding-window attention: the per-layer windows derived from Megatron's fields, the mask's exact semantics
(HF's ``sliding_window``), packing (document boundaries and window), the block-local path for long sequences,
the per-forward mask memo, and the KV cache that keeps only the window."""

from __future__ import annotations

import pytest
import torch

from tests.models.gpt_test_config import llama_config

from longspan.core.errors import ConfigError, NotSupportedError
from longspan.models import sliding_window as sw
from longspan.models.args import TransformerArgs
from longspan.models.gpt import build_gpt_model
from longspan.models.layer_pattern import (
    layer_types_from_windows,
    layer_windows,
    window_pattern_from_layer_types,
)
from longspan.models.transformer import KVCache


def _reference_attention(q, k, v, window, base=None):
    """Naive scores + mask + softmax, HF's rule: query i sees key j when 0 <= i - j < window (bottom-right)."""
    sq, sk = q.shape[2], k.shape[2]
    i = torch.arange(sq)[:, None] + (sk - sq)
    j = torch.arange(sk)[None, :]
    masked = (j > i) | (j <= i - window)
    if base is not None:
        masked = masked | base
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    return scores.masked_fill(masked, float("-inf")).softmax(-1) @ v


# ------------------------------------------------------------------------------------------ config → windows

@pytest.mark.parametrize("window,skip,expected", [
    (None, None, [None] * 6),
    ([3, 0], None, [4] * 6),
    ([-1, 0], 2, [None] * 6),
    ([7, 0], 3, [8, 8, None, 8, 8, None]),  # Megatron: one full layer after N-1 SWA layers
    ([7, 0], 1, [None] * 6),
    ([0, 0], [1, 0, 1, 1, 0, 0], [1, None, 1, 1, None, None]),
])
def test_layer_windows_follow_megatron_fields(window, skip, expected):
    cfg = llama_config(num_layers=6, window_size=window, window_attn_skip_freq=skip)
    assert layer_windows(cfg) == expected
    args = TransformerArgs.from_config(cfg)
    assert args.layer_windows == expected
    assert args.window_size == (None if window is None else tuple(window))


@pytest.mark.parametrize("overrides,error,match", [
    (dict(window_size=[4, 2]), NotSupportedError, r"model.window_size=\[4, 2\]: right=2"),
    (dict(window_size=[-2, 0]), ConfigError, "left=-2 must be >= 0"),
    (dict(window_size=[4]), ConfigError, "must be two integers"),
    (dict(window_size=[4, 0], window_attn_skip_freq=0), ConfigError, "window_attn_skip_freq=0 must be >= 1"),
    (dict(window_size=[4, 0], window_attn_skip_freq=[1, 0]), ConfigError, r"one 0/1 entry per layer \(3 layers"),
    (dict(window_size=[4, 0], window_attn_skip_freq=[1, 2, 0]), ConfigError, "one 0/1 entry per layer"),
    (dict(window_attn_skip_freq=2), ConfigError, "window_attn_skip_freq=2 needs model.window_size"),
])
def test_bad_window_settings_fail_in_one_line(overrides, error, match):
    with pytest.raises(error, match=match):
        TransformerArgs.from_config(llama_config(num_layers=3, **overrides))


def test_hf_layer_types_round_trip_through_the_skip_list():
    types = ["sliding_attention", "sliding_attention", "full_attention"]
    pattern = window_pattern_from_layer_types(types)
    assert pattern == [1, 1, 0]
    windows = layer_windows(llama_config(num_layers=3, window_size=[3, 0], window_attn_skip_freq=pattern))
    assert layer_types_from_windows(windows) == types
    with pytest.raises(NotSupportedError, match="layer_types\\[0\\]='chunked_attention'"):
        window_pattern_from_layer_types(["chunked_attention"])


def test_hf_sliding_window_semantics():
    """transformers' sliding_window_causal_mask_function is the band: HF's W == layer window W == left + 1."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    for window in (1, 3, 8):
        fn = sliding_window_causal_mask_function(window)
        t = torch.tensor
        hf = torch.tensor([[bool(fn(t(0), t(0), t(i), t(j))) for j in range(12)] for i in range(12)])
        assert torch.equal(~sw.band_mask(12, 12, window, 0), hf)
        args = TransformerArgs.from_config(llama_config(window_size=[window - 1, 0]))
        assert args.layer_windows == [window, window]


# -------------------------------------------------------------------------------------------- the attention

@pytest.mark.parametrize("sq,sk,window", [(40, 40, 5), (40, 40, 64), (1, 9, 8), (3, 12, 8), (40, 47, 8),
                                          (100, 100, 3)])
@pytest.mark.parametrize("with_base", [False, True])
def test_windowed_attention_equals_masked_reference(monkeypatch, sq, sk, window, with_base):
    monkeypatch.setattr(sw, "MIN_CHUNK", 8)  # small chunks: the block-local path runs on short sequences
    g = torch.Generator().manual_seed(sq * 7 + sk)
    q, k, v = (torch.randn(2, 3, n, 16, generator=g, dtype=torch.float64) for n in (sq, sk, sk))
    base = None
    if with_base:
        base = torch.rand(2, 1, sq, sk, generator=g) > 0.7
        rows = torch.arange(sq)
        base[:, :, rows, rows + sk - sq] = False  # every token sees itself
    out = sw.windowed_attention(q, k, v, sw.WindowedMask(window, base))
    torch.testing.assert_close(out, _reference_attention(q, k, v, window, base), atol=1e-12, rtol=0)


def test_block_local_path_skips_keys_outside_the_window(monkeypatch):
    """Long sequences: every SDPA call sees at most chunk + window - 1 keys (the work grows with the window)."""
    monkeypatch.setattr(sw, "MIN_CHUNK", 16)
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        calls.append((q.shape[2], k.shape[2]))
        return real(q, k, v, **kw)

    monkeypatch.setattr(sw.F, "scaled_dot_product_attention", spy)
    q = k = v = torch.randn(1, 2, 256, 8)
    sw.windowed_attention(q, k, v, sw.WindowedMask(16, None))
    assert len(calls) == 256 // 16 and max(keys for _, keys in calls) == 16 + 16 - 1


def test_masks_are_built_once_per_forward_per_window(monkeypatch):
    calls = []
    real = sw.band_mask
    monkeypatch.setattr(sw, "band_mask", lambda *a, **kw: calls.append(a) or real(*a, **kw))
    cfg = llama_config(num_layers=6, window_size=[3, 0], window_attn_skip_freq=3)
    model = build_gpt_model(cfg, seed=1)
    mask = ~torch.tril(torch.ones(16, 16, dtype=torch.bool)).view(1, 1, 16, 16)
    model(torch.randint(0, 100, (2, 16)), attention_mask=mask)
    assert len(calls) == 1  # 4 sliding layers, one window: one band
    model(torch.randint(0, 100, (2, 16)), attention_mask=mask)
    assert len(calls) == 2  # a new forward builds it again (the mask may have changed)


def _full_attention_layers_match(model_a, model_b, tokens, **kw):
    return torch.testing.assert_close(model_a(tokens, **kw), model_b(tokens, **kw), atol=1e-5, rtol=1e-5)


def test_window_changes_the_output_only_where_it_cuts():
    tokens = torch.randint(0, 100, (2, 24), generator=torch.Generator().manual_seed(0))
    full = build_gpt_model(llama_config(), seed=3)
    windowed = build_gpt_model(llama_config(window_size=[5, 0]), seed=3)
    wide = build_gpt_model(llama_config(window_size=[23, 0]), seed=3)  # reaches every earlier token
    out_full, out_win = full(tokens), windowed(tokens)
    torch.testing.assert_close(out_win[:, :6], out_full[:, :6], atol=1e-5, rtol=1e-5)  # window not reached yet
    assert (out_win[:, 6:] - out_full[:, 6:]).abs().max() > 1e-3
    torch.testing.assert_close(wide(tokens), out_full, atol=1e-5, rtol=1e-5)


def _windowed_layer_oracle(model, tokens, window):
    """The model's logits with every windowed layer's attention run by the naive reference."""
    from longspan.models import transformer as tm

    real = tm.core_attention

    def naive(q, k, v, mask, dropout_p, scale):
        if not isinstance(mask, sw.WindowedMask):
            return real(q, k, v, mask, dropout_p, scale)
        n_rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(n_rep, 1), v.repeat_interleave(n_rep, 1)
        return _reference_attention(q, k, v, mask.window, mask.aligned_base(q.shape[2], k.shape[2]))

    for layer in model.decoder.layers.values():
        layer.self_attention.core_attention = naive
    try:
        return model(tokens)
    finally:
        for layer in model.decoder.layers.values():
            layer.self_attention.core_attention = real


def test_model_with_alternating_windows_equals_naive_oracle(monkeypatch):
    monkeypatch.setattr(sw, "MIN_CHUNK", 8)
    cfg = llama_config(num_layers=4, window_size=[6, 0], window_attn_skip_freq=2, seq_length=64)
    model = build_gpt_model(cfg, seed=5)
    tokens = torch.randint(0, 100, (2, 50), generator=torch.Generator().manual_seed(1))
    assert [layer.self_attention.window for layer in model.decoder.layers.values()] == [7, None, 7, None]
    torch.testing.assert_close(model(tokens), _windowed_layer_oracle(model, tokens, 7), atol=1e-5, rtol=1e-5)


def test_packed_documents_with_window_equal_separate_documents(monkeypatch):
    """Packing: document boundaries and the window together; each document equals itself run alone."""
    monkeypatch.setattr(sw, "MIN_CHUNK", 8)
    cfg = llama_config(window_size=[4, 0], seq_length=64)
    model = build_gpt_model(cfg, seed=2)
    g = torch.Generator().manual_seed(3)
    lengths = [13, 20, 7]
    docs = [torch.randint(0, 100, (1, n), generator=g) for n in lengths]
    packed = torch.cat(docs, dim=1)
    total = packed.shape[1]
    mask = torch.ones(total, total, dtype=torch.bool)
    positions, start = [], 0
    for n in lengths:
        mask[start:start + n, start:start + n] = ~torch.tril(torch.ones(n, n, dtype=torch.bool))
        positions.append(torch.arange(n))
        start += n
    out = model(packed, position_ids=torch.cat(positions)[None], attention_mask=mask[None, None])
    start = 0
    for doc, n in zip(docs, lengths):
        torch.testing.assert_close(out[:, start:start + n], model(doc), atol=1e-5, rtol=1e-5)
        start += n


def test_gradients_of_block_local_path_equal_dense(monkeypatch):
    cfg = llama_config(window_size=[5, 0], seq_length=64)
    tokens = torch.randint(0, 100, (2, 48), generator=torch.Generator().manual_seed(4))
    labels = torch.roll(tokens, -1, 1)
    grads = []
    for chunk in (10_000, 8):  # dense mask, then block-local
        monkeypatch.setattr(sw, "MIN_CHUNK", chunk)
        model = build_gpt_model(cfg, seed=2)
        model(tokens, labels=labels).mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, atol=1e-6, rtol=1e-5)


# ----------------------------------------------------------------------------------------------- KV cache

def test_kv_cache_keeps_only_the_window_and_matches_recompute():
    cfg = llama_config(num_layers=3, window_size=[7, 0], window_attn_skip_freq=3, seq_length=64)
    model = build_gpt_model(cfg, seed=4).eval()
    tokens = torch.randint(0, 100, (1, 40), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = model(tokens)
        cache = KVCache(40)
        steps = [model(tokens[:, :21], kv_cache=cache)]  # a prompt longer than the window
        for i in range(21, 40):
            steps.append(model(tokens[:, i:i + 1], kv_cache=cache))
            assert cache.keys[0].shape[2] == 7 and cache.keys[1].shape[2] == 7  # window - 1 positions kept
            assert cache.keys[2].shape[2] == 40  # the full-attention layer keeps everything
    torch.testing.assert_close(torch.cat(steps, dim=1), expected, atol=1e-5, rtol=1e-5)


def test_kv_cache_chunked_prefill_with_window():
    cfg = llama_config(window_size=[4, 0], seq_length=64)
    model = build_gpt_model(cfg, seed=6).eval()
    tokens = torch.randint(0, 100, (1, 30), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        cache = KVCache(30)
        parts = [model(tokens[:, a:b], kv_cache=cache) for a, b in ((0, 3), (3, 17), (17, 18), (18, 30))]
        torch.testing.assert_close(torch.cat(parts, dim=1), model(tokens), atol=1e-5, rtol=1e-5)
