"""Pretraining samplers and data iterators: Megatron's order, sizes, and exact mid-epoch resume."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
import torch

from longspan.core.errors import DataError
from longspan.data.loaders import build_train_valid_test_data_iterators, get_train_valid_test_num_samples
from longspan.data.samplers import MegatronPretrainingRandomSampler, MegatronPretrainingSampler

from tests.data.conftest import LongspanTok, gpt_dataset_config, run_config


def test_single_sampler_order_against_formula():
    total, consumed, mbs, dp = 103, 16, 2, 4
    for rank in range(dp):
        got = list(MegatronPretrainingSampler(total, consumed, mbs, rank, dp))
        # Global batch j holds indices consumed + 8j ... consumed + 8j + 7; rank r takes its r-th pair.
        expected = [[consumed + 8 * j + rank * mbs + k for k in range(mbs)] for j in range((total - consumed) // 8)]
        assert got == expected


def test_single_sampler_keeps_last_partial_batch_without_drop_last():
    got = list(MegatronPretrainingSampler(10, 0, 2, 0, 2, drop_last=False))
    assert got[-1] == [8, 9] and len(got) == 3


@pytest.mark.parametrize("sharding", [True, False])
def test_random_sampler_resumes_mid_epoch_and_across_epochs(sharding):
    total, mbs, dp = 50, 2, 2  # 48 usable samples per epoch: 12 global micro-batches
    def stream(rank, consumed, n):
        out = []
        while len(out) < n:
            s = MegatronPretrainingRandomSampler(None, total, consumed, mbs, rank, dp, sharding)
            for batch in s:
                out.append(batch)
                consumed += mbs * dp
                if len(out) == n:
                    break
        return out
    for rank in range(dp):
        full = stream(rank, 0, 30)  # spans three epochs
        for k in (1, 5, 12, 17):
            assert stream(rank, k * mbs * dp, 30 - k) == full[k:]
    # one epoch of both ranks covers each usable index at most once and draws from [0, total)
    epoch = [i for r in range(dp) for b in stream(r, 0, 12) for i in b]
    assert len(set(epoch)) == len(epoch) == 48 and max(epoch) < total


def test_random_sampler_epoch_order_is_a_seeded_permutation():
    # Without sharding, rank r of dp takes every dp-th index of randperm(full bucket) seeded by the epoch.
    s = MegatronPretrainingRandomSampler(None, 20, 0, 2, 1, 2, data_sharding=False)
    g = torch.Generator()
    g.manual_seed(0)
    perm = torch.randperm(20, generator=g).tolist()
    got = [i for b in s for i in b]
    assert got == perm[1::2]


def test_sampler_errors_are_data_errors():
    with pytest.raises(DataError):
        MegatronPretrainingSampler(0, 0, 1, 0, 1)
    with pytest.raises(DataError):
        MegatronPretrainingSampler(10, 10, 1, 0, 1)


def _cfg(prefix, dl_type="single", **train):
    t = dict(train_iters=30, train_samples=None, global_batch_size=8, micro_batch_size=2, eval_interval=10,
             eval_iters=2, skip_train=False)
    t.update(train)
    ds = gpt_dataset_config(data_path=prefix, split="90,8,2", dataloader_type=dl_type, num_workers=0)
    return run_config(ds, 64, **t)


def test_num_samples_formulas():
    cfg = _cfg(None)
    assert get_train_valid_test_num_samples(cfg) == (30 * 8, (30 // 10 + 1) * 2 * 8, 2 * 8)
    cfg = _cfg(None, train_samples=100, train_iters=None)
    assert get_train_valid_test_num_samples(cfg) == (100, (100 // 8 // 10 + 1) * 2 * 8, 16)


def _take(it, n):
    return [next(it) for _ in range(n)]


@pytest.mark.parametrize("dl_type", ["single", "cyclic"])
def test_iterators_resume_exactly(two_prefixes, dl_type):
    p1, _ = two_prefixes
    cfg = _cfg(p1, dl_type)
    dp, per_iter = 2, 8 // (2 * 2)  # micro-batches per iteration per rank
    for rank in range(dp):
        state = NS(consumed_train_samples=0, consumed_valid_samples=0)
        train, valid, _ = build_train_valid_test_data_iterators(cfg, state, LongspanTok(), rank, dp)
        full = _take(train, 12 * per_iter)
        resumed_state = NS(consumed_train_samples=5 * 8, consumed_valid_samples=0)
        train2, _, _ = build_train_valid_test_data_iterators(cfg, resumed_state, LongspanTok(), rank, dp)
        rest = _take(train2, 7 * per_iter)
        for a, b in zip(full[5 * per_iter :], rest):
            for k in a:
                assert torch.equal(a[k], b[k])
        batch = full[0]
        assert batch["tokens"].shape == (2, 64) and batch["tokens"].dtype == torch.int64
        assert batch["labels"].dtype == torch.int64 and batch["position_ids"].dtype == torch.int64
        assert batch["loss_mask"].dtype == torch.float32
        assert batch["attention_mask"].shape == (2, 1, 64, 64) and batch["attention_mask"].dtype == torch.bool


def test_single_iterator_reads_the_dataset_in_order(two_prefixes):
    from longspan.data.loaders import build_train_valid_test_datasets

    p1, _ = two_prefixes
    cfg = _cfg(p1)
    train_ds = build_train_valid_test_datasets(cfg, LongspanTok())[0]
    train, valid, test = build_train_valid_test_data_iterators(cfg, NS(consumed_train_samples=16, consumed_valid_samples=0), LongspanTok(), 1, 2)
    batch = next(train)  # global batch starting at sample 16; rank 1 holds samples 18, 19
    assert torch.equal(batch["tokens"], torch.stack([train_ds[18]["tokens"], train_ds[19]["tokens"]]))
    # validation cycles: more batches than the valid split holds keep coming
    n_valid = (30 // 10 + 1) * 2 * 8
    assert len(_take(valid, n_valid)) == n_valid


def test_sequence_length_longer_than_model(two_prefixes):
    p1, _ = two_prefixes
    cfg = _cfg(p1)
    cfg.model.seq_length = 32
    with pytest.raises(DataError) as e:
        build_train_valid_test_data_iterators(cfg, NS(consumed_train_samples=0, consumed_valid_samples=0), LongspanTok())
    assert "dataset.sequence_length=64" in str(e.value) and "model.seq_length=32" in str(e.value)


def test_mock_data_when_no_path():
    cfg = _cfg(None)
    cfg.dataset.split = None
    train, _, _ = build_train_valid_test_data_iterators(cfg, NS(consumed_train_samples=0, consumed_valid_samples=0), LongspanTok(vocab_size=100, eod=0))
    tokens = next(train)["tokens"]
    assert tokens.shape == (2, 64) and int(tokens.max()) < 100
