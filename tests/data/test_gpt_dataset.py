"""GPT / blended / mock datasets equal megatron-core's sample for sample; index builders equal its C++."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from longspan.core.errors import DataError
from longspan.data.blended import BlendedMegatronDatasetBuilder
from longspan.data.gpt_dataset import GPTDataset, MockGPTDataset
from longspan.data.indices import build_blending_indices, build_exhaustive_blending_indices, build_sample_index

from tests.data.conftest import LongspanTok, OracleTokenizer, gpt_dataset_config, random_docs, write_corpus
from tests.oracles import oracle

pytestmark = pytest.mark.megatron

# Oracles, imported by the tests that use them: oracle-free tests run without megatron-core.
mg = oracle("megatron.core.datasets.gpt_dataset")
mb = oracle("megatron.core.datasets.blended_megatron_dataset_builder")
helpers = oracle("megatron.core.datasets.helpers_cpp")

KEYS = ("tokens", "labels", "loss_mask", "position_ids", "attention_mask")
SIZES = [1000, 300, 100]


def _megatron(cls, sizes, **kw):
    flags = dict(reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False)
    flags.update(kw)
    tok = flags.pop("tokenizer", OracleTokenizer())
    config = mg.GPTDatasetConfig(random_seed=flags.pop("random_seed", 1234), sequence_length=64, tokenizer=tok, **flags)
    return mb.BlendedMegatronDatasetBuilder(cls, sizes, lambda: True, config).build()


def _ours(cls, sizes, **kw):
    kw.setdefault("tokenizer", LongspanTok())
    return BlendedMegatronDatasetBuilder(cls, sizes, lambda: True, gpt_dataset_config(**kw)).build()


def _assert_same(ref_splits, got_splits, which=None):
    for ref, got in zip(ref_splits, got_splits):
        assert (ref is None) == (got is None)
        if ref is None:
            continue
        assert len(ref) == len(got)
        for i in which(len(ref)) if which else range(len(ref)):
            a, b = ref[i], got[i]
            assert set(b) >= {k for k in KEYS if k in a}
            for k in KEYS:
                if k in a:
                    assert a[k].dtype == b[k].dtype, k
                    assert torch.equal(a[k], b[k]), (k, i)


@pytest.mark.parametrize(
    "flags", [{}, dict(eod_mask_loss=True, reset_position_ids=True, reset_attention_mask=True)], ids=["plain", "resets"]
)
def test_weighted_blend_of_two_prefixes(two_prefixes, tmp_path, flags):
    p1, p2 = two_prefixes
    blend = [[p1, p2], [0.3, 0.7]]
    ref = _megatron(mg.GPTDataset, SIZES, blend=blend, split="90,8,2", **flags)
    got = _ours(GPTDataset, SIZES, blend=blend, split="90,8,2", path_to_cache=str(tmp_path / "c"), **flags)
    _assert_same(ref, got)
    # the resets are visible in the samples (so the comparison above covered them)
    if flags:
        assert any(got[0][i]["position_ids"][-1] < 63 for i in range(20))


def test_single_prefix_and_unweighted_blend(two_prefixes, tmp_path):
    p1, p2 = two_prefixes
    for blend in ([[p1], None], [[p1, p2], None]):
        ref = _megatron(mg.GPTDataset, SIZES, blend=blend, split="90,8,2")
        got = _ours(GPTDataset, SIZES, blend=blend, split="90,8,2")
        _assert_same(ref, got)


def test_blend_per_split_multi_epoch_no_extra_token_padded_valid(two_prefixes):
    p1, p2 = two_prefixes
    kw = dict(
        blend_per_split=[[[p1, p2], [1.0, 2.0]], [[p2], None], [[p1], None]],
        add_extra_token_to_sequence=False,
        drop_last_partial_validation_sequence=False,
    )
    sizes = [5000, 40, None]  # 5000 samples need several epochs
    ref = _megatron(mg.GPTDataset, sizes, tokenizer=OracleTokenizer(pad=7), **kw)
    got = _ours(GPTDataset, sizes, split=None, tokenizer=LongspanTok(pad=7), **kw)
    _assert_same(ref, got)


def test_mock_data(tmp_path):
    ref = _megatron(mg.MockGPTDataset, [200, 50, 20], tokenizer=OracleTokenizer(vocab_size=500, eod=3), random_seed=5)
    got = _ours(MockGPTDataset, [200, 50, 20], split=None, tokenizer=LongspanTok(vocab_size=500, eod=3), random_seed=5)
    # One epoch of mock data is about a million samples per split: compare the ends and a random sample.
    picks = lambda n: list(range(64)) + list(np.random.default_rng(0).integers(0, n, 64)) + list(range(n - 16, n))
    _assert_same(ref, got, which=picks)


def test_padding_sample_and_cache_reuse(two_prefixes, tmp_path):
    p1, _ = two_prefixes
    cache = tmp_path / "cache"
    first = _ours(GPTDataset, SIZES, blend=[[p1], None], path_to_cache=str(cache))[0]
    files = sorted(os.listdir(cache))
    assert any(f.endswith("-GPTDataset-train-sample_index.npy") for f in files)
    assert any(f.endswith("-GPTDataset-train-description.txt") for f in files)
    second = _ours(GPTDataset, SIZES, blend=[[p1], None], path_to_cache=str(cache))[0]
    assert sorted(os.listdir(cache)) == files
    assert isinstance(second.sample_index, np.memmap)  # loaded, not rebuilt
    for i in (0, 5, len(first) - 1):
        assert torch.equal(first[i]["tokens"], second[i]["tokens"])
    pad = first[None]
    assert pad["loss_mask"].sum() == 0 and pad["tokens"].shape == (64,)


@pytest.mark.parametrize("extra", [0, 1])
@pytest.mark.parametrize("drop_last", [True, False])
def test_sample_index_equals_megatron_cpp(extra, drop_last):
    rng = np.random.default_rng(extra * 2 + drop_last)
    for trial in range(20):
        sizes = rng.integers(0 if trial % 2 else 1, 300, int(rng.integers(2, 400))).astype(np.int32)
        sizes[0] = max(sizes[0], 3)
        epochs, seq = int(rng.integers(1, 4)), int(rng.integers(2, 130))
        doc_index = np.tile(np.arange(len(sizes), dtype=np.int32), epochs)
        rng.shuffle(doc_index)
        tpe = int(sizes.sum())
        ref = helpers.build_sample_idx_int32(sizes, doc_index, seq, epochs, tpe, drop_last, extra)
        got = build_sample_index(sizes, doc_index, seq, epochs, tpe, drop_last, bool(extra))
        np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("k", [1, 2, 3, 7])
def test_blending_indices_equal_megatron_cpp(k):
    rng = np.random.default_rng(k)
    for trial in range(5):
        w = rng.random(k) if trial else np.ones(k)
        w = w / w.sum()
        size = int(rng.integers(1, 30000))
        di, dsi = np.zeros(size, np.int16), np.zeros(size, np.int64)
        helpers.build_blending_indices(di, dsi, w, k, size, False)
        a, b = build_blending_indices(w, size)
        np.testing.assert_array_equal(a, di)
        np.testing.assert_array_equal(b, dsi)
    sizes = rng.integers(1, 500, k).astype(np.int64)
    di, dsi = np.zeros(sizes.sum(), np.int16), np.zeros(sizes.sum(), np.int64)
    helpers.build_exhaustive_blending_indices(di, dsi, sizes, k)
    a, b = build_exhaustive_blending_indices(sizes)
    np.testing.assert_array_equal(a, di)
    np.testing.assert_array_equal(b, dsi)


@pytest.mark.parametrize("weights,needle", [([-0.5, 1.0], "-0.5"), ([0.0, 0.0], "all zero")])
def test_bad_blend_weights(two_prefixes, weights, needle):
    p1, p2 = two_prefixes
    with pytest.raises(DataError) as e:
        _ours(GPTDataset, SIZES, blend=[[p1, p2], weights])
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_empty_split(tmp_path):
    prefix = str(tmp_path / "small")
    write_corpus(prefix, random_docs(3, 20))
    with pytest.raises(DataError) as e:
        _ours(GPTDataset, SIZES, blend=[[prefix], None], split="99,1,0")  # 1% of 20 documents: none
    assert "valid split" in str(e.value) and "small" in str(e.value) and "\n" not in str(e.value)


def test_missing_prefix_in_blend(two_prefixes, tmp_path):
    p1, _ = two_prefixes
    with pytest.raises(DataError) as e:
        _ours(GPTDataset, SIZES, blend=[[p1, str(tmp_path / "missing")], [0.5, 0.5]])
    assert "missing" in str(e.value) and "\n" not in str(e.value)
