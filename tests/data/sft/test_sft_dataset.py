"""SFT datasets: the cached line index, seeded epochs that resume exactly, padding, errors, loader dispatch."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from longspan.core.errors import ConfigError, DataError
from longspan.data.sft.dataset import EpochSampleMap, SFTDataset
from longspan.data.sft.formatting import parse_format_options
from longspan.data.sft.jsonl_index import JsonlIndex
from tests.data.conftest import run_config
from tests.data.sft.conftest import qa_records, write_jsonl


def test_index_is_built_once_and_reused(tmp_path, monkeypatch):
    scans = []
    build = JsonlIndex._build
    monkeypatch.setattr(JsonlIndex, "_build", lambda self, workers: scans.append(self.path) or build(self, workers))
    path = write_jsonl(str(tmp_path / "training.jsonl"), qa_records(50) + [""] + qa_records(3, seed=1))
    index = JsonlIndex(path)
    assert scans == [path] and len(index) == 53  # the blank line is not a record
    assert os.path.isfile(path + ".idx.npy") and os.path.isfile(path + ".idx.json")
    cache_mtime = os.stat(path + ".idx.npy").st_mtime_ns
    again = JsonlIndex(path)
    assert scans == [path]  # reused: the file was not scanned again
    assert os.stat(path + ".idx.npy").st_mtime_ns == cache_mtime
    assert again.record(52) == qa_records(3, seed=1)[2]
    assert index.line_number(52) == 54
    # an edited file (same size or not) gets a new index
    time.sleep(0.01)
    write_jsonl(path, qa_records(7, seed=5))
    assert len(JsonlIndex(path)) == 7 and scans == [path, path]


def test_index_handles_crlf_missing_final_newline_and_workers(tmp_path):
    path = str(tmp_path / "x.jsonl")
    with open(path, "wb") as f:
        f.write(b'{"input": "a", "output": "b"}\r\n\r\n{"input": "c", "output": "d"}')
    index = JsonlIndex(path, workers=3)
    assert len(index) == 2 and index.record(1) == {"input": "c", "output": "d"}


def test_bad_lines_name_the_file_and_line(tmp_path):
    """Indexing parses every line: a bad one is found when the file is opened, not when its sample is drawn."""
    path = write_jsonl(str(tmp_path / "bad.jsonl"), qa_records(2) + ['{"input": "x", "output": '] + qa_records(1))
    with pytest.raises(DataError, match=r"bad.jsonl line 3: not valid JSON"):
        JsonlIndex(path)
    assert not os.path.exists(path + ".idx.npy")  # no cache of a file that failed
    write_jsonl(path, qa_records(1) + ["", "[1, 2]"])
    with pytest.raises(DataError, match=r"line 3: expected a JSON object, got list"):
        JsonlIndex(path)
    with pytest.raises(DataError, match="does not exist"):
        JsonlIndex(str(tmp_path / "missing.jsonl"))


def test_missing_key_error_names_the_line(tmp_path, tokenizer):
    path = write_jsonl(str(tmp_path / "t.jsonl"), qa_records(3) + ["    ", {"question": "x", "output": "y"}])
    with pytest.raises(DataError, match=r"t.jsonl line 5: the record has no 'input' key"):
        SFTDataset(path, tokenizer, 64, None, 1, False, parse_format_options(None))
    # checked from the cached key sets too (a second open does not scan the file)
    with pytest.raises(DataError, match=r"t.jsonl line 5: the record has no 'input' key"):
        SFTDataset(path, tokenizer, 64, None, 1, False, parse_format_options(None))


def test_epoch_map_is_seeded_covers_each_epoch_and_resumes():
    m = EpochSampleMap(7, 30, seed=3, shuffle=True)
    order = [m[i] for i in range(30)]
    for e in range(4):
        assert sorted(order[7 * e:7 * e + 7]) == list(range(7))
    assert order[:7] != order[7:14]
    assert order == [EpochSampleMap(7, 30, 3, True)[i] for i in range(30)]
    assert order != [EpochSampleMap(7, 30, 4, True)[i] for i in range(30)]
    assert [EpochSampleMap(7, 10, 3, False)[i] for i in range(10)] == [0, 1, 2, 3, 4, 5, 6, 0, 1, 2]


def _cfg(root, train_iters=6, gbs=4, mbs=2, seq=48, **dataset):
    from longspan.config.schema.data import FinetuningDatasetConfig

    dataset.setdefault("num_workers", 0)
    d = FinetuningDatasetConfig(dataset_root=str(root), seq_length=seq, **dataset)
    return run_config(d, seq, micro_batch_size=mbs, global_batch_size=gbs, train_iters=train_iters, eval_iters=1,
                      eval_interval=3)


@pytest.fixture
def sft_root(tmp_path):
    write_jsonl(str(tmp_path / "training.jsonl"), qa_records(11, seed=1))
    write_jsonl(str(tmp_path / "validation.jsonl"), qa_records(5, seed=2))
    return tmp_path


def _take(it, n):
    return [next(it) for _ in range(n)]


def test_loader_dispatch_batches_and_exact_resume(sft_root, tokenizer):
    from longspan.data.loaders import build_train_valid_test_data_iterators

    cfg = _cfg(sft_root)
    state = SimpleNamespace(consumed_train_samples=0, consumed_valid_samples=0)
    train, valid, test = build_train_valid_test_data_iterators(cfg, state, tokenizer)
    assert test is None  # no test.jsonl: skipped
    batches = _take(train, 12)  # 24 samples: more than two epochs of 11 records
    b = batches[0]
    assert set(b) == {"tokens", "labels", "loss_mask", "position_ids", "real_tokens"}
    assert b["loss_mask"].dtype == torch.float32
    # unset pad_to_max_length without pipeline parallel: each microbatch is as wide as its longest sample,
    # rounded up to pad_seq_length_to_mult=16 (not seq_length=48); real_tokens are the rows' unpadded lengths
    assert {int(batch["tokens"].shape[1]) for batch in batches} <= {16, 32, 48}
    assert any(int(batch["tokens"].shape[1]) < 48 for batch in batches)
    # padding carries no loss; labels are the next tokens
    for batch in batches:
        width = int(batch["tokens"].shape[1])
        assert width == -(-int(batch["real_tokens"].max()) // 16) * 16
        for row in range(2):
            n = int((batch["tokens"][row] != tokenizer.pad).sum())
            assert n == int(batch["real_tokens"][row])
            assert batch["loss_mask"][row, n:].sum() == 0 and batch["loss_mask"][row, :n].sum() > 0
            assert torch.equal(batch["labels"][row, :n - 1], batch["tokens"][row, 1:n])
    # resume after 5 microbatches (10 samples, mid-epoch) gives exactly the next ones
    state = SimpleNamespace(consumed_train_samples=10, consumed_valid_samples=0)
    resumed, _, _ = build_train_valid_test_data_iterators(cfg, state, tokenizer)
    for want, got in zip(batches[5:], _take(resumed, 7)):
        for key in want:
            assert torch.equal(want[key], got[key])
    assert len(_take(valid, 6)) == 6  # validation cycles
    # DataLoader worker processes give the same batches
    cfg_workers = _cfg(sft_root, num_workers=2)
    workers, _, _ = build_train_valid_test_data_iterators(cfg_workers, SimpleNamespace(
        consumed_train_samples=0, consumed_valid_samples=0), tokenizer)
    for want, got in zip(batches[:3], _take(workers, 3)):
        assert all(torch.equal(want[k], got[k]) for k in want)
    # dp rank 1 of 2 reads the other half of each global batch
    r1, _, _ = build_train_valid_test_data_iterators(cfg, SimpleNamespace(consumed_train_samples=0,
                                                                           consumed_valid_samples=0),
                                                     tokenizer, dp_rank=1, dp_size=2)
    assert torch.equal(next(r1)["tokens"], batches[1]["tokens"])


def test_seed_and_max_train_samples_and_padding_options(sft_root, tokenizer):
    from longspan.data.loaders import build_train_valid_test_datasets

    a = build_train_valid_test_datasets(_cfg(sft_root, seed=1), tokenizer)[0]
    b = build_train_valid_test_datasets(_cfg(sft_root, seed=2), tokenizer)[0]
    assert len(a) == 24 and [a.samples[i] for i in range(11)] != [b.samples[i] for i in range(11)]
    assert len(build_train_valid_test_datasets(_cfg(sft_root, max_train_samples=40), tokenizer)[0]) == 40
    with pytest.raises(ConfigError, match="max_train_samples=10"):
        build_train_valid_test_datasets(_cfg(sft_root, max_train_samples=10), tokenizer)
    ds = build_train_valid_test_datasets(
        _cfg(sft_root, dataset_kwargs={"pad_to_max_length": False, "pad_seq_length_to_mult": 8}), tokenizer)[0]
    batch = ds.collate_fn([ds[0], ds[1]])
    longest = max(ds[0]["tokens"].numel(), ds[1]["tokens"].numel())
    assert batch["tokens"].shape[1] == -(-longest // 8) * 8 < 48


def test_do_validation_do_test_and_missing_files(sft_root, tokenizer):
    from longspan.data.loaders import build_train_valid_test_datasets

    write_jsonl(str(sft_root / "test.jsonl"), qa_records(3, seed=9))
    train, valid, test = build_train_valid_test_datasets(_cfg(sft_root), tokenizer)
    assert valid is not None and test is not None and [test.samples[i] for i in range(3)] == [0, 1, 2]
    _, valid, test = build_train_valid_test_datasets(_cfg(sft_root, do_validation=False, do_test=False), tokenizer)
    assert valid is None and test is None
    os.remove(sft_root / "validation.jsonl")
    with pytest.raises(DataError, match=r"validation.jsonl does not exist \(or set dataset.do_validation=False\)"):
        build_train_valid_test_datasets(_cfg(sft_root), tokenizer)
    with pytest.raises(DataError, match="is not a directory"):
        build_train_valid_test_datasets(_cfg(sft_root / "nope"), tokenizer)


def test_indexing_speed_is_reported(tmp_path, capsys, monkeypatch):
    """~20 MB here (benchmarks measure bigger files): the rate is reported, not asserted (it depends on the
    machine and its load); the second open reads the cached index instead of scanning again."""
    path = str(tmp_path / "big.jsonl")
    line = ('{"input": "' + "x" * 150 + '", "output": "' + "y" * 60 + '"}\n').encode()
    with open(path, "wb") as f:
        f.write(line * (20_000_000 // len(line)))
    start = time.perf_counter()
    index = JsonlIndex(path, workers=2)
    seconds = time.perf_counter() - start
    rate = os.path.getsize(path) / seconds / 1e6
    print(f"indexed {os.path.getsize(path) / 1e6:.0f} MB, {len(index)} lines at {rate:.0f} MB/s")
    builds = []
    original = JsonlIndex._build
    monkeypatch.setattr(JsonlIndex, "_build", lambda self, *a, **k: builds.append(1) or original(self, *a, **k))
    again = JsonlIndex(path)
    assert builds == [] and len(again) == len(index) == 20_000_000 // len(line)
    assert index.record(len(index) - 1)["output"] == "y" * 60
    assert isinstance(np.asarray(index.starts), np.ndarray)


def test_padding_to_the_longest_is_checked_against_the_layout(sft_root, tokenizer):
    from longspan.data.loaders import build_train_valid_test_datasets

    kwargs = {"pad_to_max_length": False, "pad_seq_length_to_mult": 6}
    cfg = _cfg(sft_root, dataset_kwargs=kwargs)
    cfg.model.pipeline_model_parallel_size = 2
    with pytest.raises(ConfigError, match="pipeline stages"):
        build_train_valid_test_datasets(cfg, tokenizer)
    cfg.model.pipeline_model_parallel_size, cfg.model.context_parallel_size = 1, 2
    with pytest.raises(ConfigError, match="must be a multiple of 4"):
        build_train_valid_test_datasets(cfg, tokenizer)
    cfg.model.context_parallel_size, cfg.model.tensor_model_parallel_size, cfg.model.sequence_parallel = 1, 4, True
    with pytest.raises(ConfigError, match="must be a multiple of 4"):
        build_train_valid_test_datasets(cfg, tokenizer)
    cfg.model.context_parallel_size, cfg.model.tensor_model_parallel_size, cfg.model.sequence_parallel = 2, 1, False
    cfg.dataset.dataset_kwargs = {"pad_to_max_length": False, "pad_seq_length_to_mult": 8}
    assert build_train_valid_test_datasets(cfg, tokenizer)[0] is not None


def test_unset_padding_is_decided_by_the_layout_and_set_values_are_kept(sft_root):
    """pad_to_max_length unset: to the longest sample, but seq_length under pipeline parallel (fixed shapes);
    an unset pad_seq_length_to_mult grows to what context parallel cuts sequences into; set values stay."""
    from longspan.data.loaders import sft_padding

    cfg = _cfg(sft_root)
    opts = sft_padding(cfg.dataset, cfg.model)
    assert (opts.pad_to_max_length, opts.pad_seq_length_to_mult) == (False, 16)
    cfg.model.pipeline_model_parallel_size = 2
    assert sft_padding(cfg.dataset, cfg.model).pad_to_max_length is True
    cfg.model.pipeline_model_parallel_size, cfg.model.context_parallel_size = 1, 3
    assert sft_padding(cfg.dataset, cfg.model).pad_seq_length_to_mult == 48  # lcm(16, 2 x 3)
    cfg.dataset.dataset_kwargs = {"pad_seq_length_to_mult": 8}
    with pytest.raises(ConfigError, match="pad_seq_length_to_mult=8 must be a multiple of 6"):
        sft_padding(cfg.dataset, cfg.model)  # set by the user: reported, never changed
    cfg.dataset.dataset_kwargs = {"pad_to_max_length": True}
    assert sft_padding(cfg.dataset, cfg.model).pad_to_max_length is True


def test_chat_records_use_the_configured_template(tmp_path, tokenizer):
    from longspan.data.loaders import build_train_valid_test_datasets
    from tests.data.sft.conftest import LLAMA3_TEMPLATE

    chats = [{"messages": [{"role": "user", "content": "hello world"},
                           {"role": "assistant", "content": "the lazy dog" * (i % 3 + 1)}]} for i in range(6)]
    write_jsonl(str(tmp_path / "training.jsonl"), chats)
    cfg = _cfg(tmp_path, do_validation=False, seq=64)
    cfg.tokenizer.chat_template = LLAMA3_TEMPLATE
    train = build_train_valid_test_datasets(cfg, tokenizer)[0]
    sample = train[0]
    assert int(sample["tokens"][0]) == tokenizer.bos  # Llama-3's template, not the tokenizer's ChatML
    record = chats[train.samples[0]]["messages"][1]["content"]
    trained = tokenizer.detokenize(sample["labels"][sample["loss_mask"] > 0].tolist())
    assert trained == record + "<|eot_id|>"
