"""IndexedDataset / IndexedDatasetBuilder against megatron-core's (format, round trips, damaged files)."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest
import torch

from longspan.core.errors import DataError
from longspan.data.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder
from tests.oracles import oracle

pytestmark = pytest.mark.megatron

mc = oracle("megatron.core.datasets.indexed_dataset")  # imported by the oracle tests that use it


def _docs(seed=0, n=40, vocab=30000):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=int(rng.integers(1, 50))) for _ in range(n)]


def _write(builder_cls, prefix, docs, dtype, multimodal=False):
    b = builder_cls(prefix + ".bin", dtype=dtype, multimodal=multimodal)
    for i, d in enumerate(docs):
        if i % 3 == 2:  # a document of two sequences through add_document
            cut = len(d) // 2
            kwargs = {"modes": [1, 2]} if multimodal else {}
            b.add_document(torch.tensor(d), [cut, len(d) - cut], **kwargs)
        else:
            kwargs = {"mode": i % 4} if multimodal else {}
            b.add_item(torch.tensor(d), **kwargs)
            b.end_document()
    b.finalize(prefix + ".idx")


def _read_bytes(path):
    with open(path, "rb") as f:
        return f.read()


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.int64])
@pytest.mark.parametrize("multimodal", [False, True])
def test_files_byte_identical_to_megatron(tmp_path, dtype, multimodal):
    docs = _docs()
    ours, theirs = str(tmp_path / "ours"), str(tmp_path / "theirs")
    _write(IndexedDatasetBuilder, ours, docs, dtype, multimodal)
    _write(mc.IndexedDatasetBuilder, theirs, docs, dtype, multimodal)
    for ext in (".bin", ".idx"):
        assert _read_bytes(ours + ext) == _read_bytes(theirs + ext)


@pytest.mark.parametrize("multimodal", [False, True])
@pytest.mark.parametrize("mmap", [True, False])
def test_read_both_directions(tmp_path, multimodal, mmap):
    docs = _docs(1)
    for writer, reader in ((mc.IndexedDatasetBuilder, IndexedDataset), (IndexedDatasetBuilder, mc.IndexedDataset)):
        prefix = str(tmp_path / f"{writer.__module__.split('.')[0]}")
        _write(writer, prefix, docs, np.int32, multimodal)
        ref = mc.IndexedDataset(prefix, multimodal=multimodal, mmap=True)
        got = reader(prefix, multimodal=multimodal, mmap=mmap)
        assert len(got) == len(ref)
        np.testing.assert_array_equal(got.sequence_lengths, ref.sequence_lengths)
        np.testing.assert_array_equal(got.document_indices, ref.document_indices)
        for i in range(len(ref)):
            a, b = ref[i], got[i]
            if multimodal:
                np.testing.assert_array_equal(a[0], b[0])
                assert a[1] == b[1]
            else:
                np.testing.assert_array_equal(a, b)
            np.testing.assert_array_equal(
                np.asarray(ref.get(i, offset=0, length=1)[0] if multimodal else ref.get(i, 0, 1)),
                np.asarray(got.get(i, 0, 1)[0] if multimodal else got.get(i, 0, 1)),
            )
        sl_ref, sl_got = ref[2:7], got[2:7]
        if multimodal:
            sl_ref, sl_got = sl_ref[0], sl_got[0]
        for a, b in zip(sl_ref, sl_got):
            np.testing.assert_array_equal(a, b)


def test_documents_round_trip_and_get_offsets(tmp_path):
    docs = _docs(2)
    prefix = str(tmp_path / "d")
    b = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for d in docs:
        b.add_item(d)
        b.end_document()
    b.finalize(prefix + ".idx")
    ds = IndexedDataset(prefix)
    assert ds.dtype == np.uint16
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(ds[i], d)
        if len(d) > 3:
            np.testing.assert_array_equal(ds.get(i, offset=1, length=2), d[1:3])
            np.testing.assert_array_equal(ds.get(i, offset=2), d[2:])
    np.testing.assert_array_equal(ds.document_indices, np.arange(len(docs) + 1))


def test_add_index_matches_megatron(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    _write(IndexedDatasetBuilder, a, _docs(3, 10), np.int32)
    _write(IndexedDatasetBuilder, b, _docs(4, 12), np.int32)
    outs = {}
    for name, cls in (("ours", IndexedDatasetBuilder), ("theirs", mc.IndexedDatasetBuilder)):
        p = str(tmp_path / name)
        builder = cls(p + ".bin", dtype=np.int32)
        builder.add_index(a)
        builder.add_index(b)
        builder.finalize(p + ".idx")
        outs[name] = p
    for ext in (".bin", ".idx"):
        assert _read_bytes(outs["ours"] + ext) == _read_bytes(outs["theirs"] + ext)


def test_optimal_dtype_and_codes():
    assert DType.optimal_dtype(65499) == np.uint16
    assert DType.optimal_dtype(65500) == np.int32
    assert DType.code_from_dtype(np.uint16) == 8 and DType.code_from_dtype(np.int32) == 4


# ---------------------------------------------------------------------------------------- damaged data
@pytest.fixture
def good_prefix(tmp_path):
    prefix = str(tmp_path / "good")
    _write(IndexedDatasetBuilder, prefix, _docs(5, 10), np.int32)
    return prefix


def _expect_one_line(excinfo, *needles):
    msg = str(excinfo.value)
    assert "\n" not in msg
    for n in needles:
        assert n in msg, msg


def _patch(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_missing_prefix(tmp_path):
    with pytest.raises(DataError) as e:
        IndexedDataset(str(tmp_path / "nope"))
    _expect_one_line(e, "nope.idx", "not found")


def test_truncated_bin(good_prefix):
    size = os.path.getsize(good_prefix + ".bin")
    with open(good_prefix + ".bin", "r+b") as f:
        f.truncate(size - 4)
    with pytest.raises(DataError) as e:
        IndexedDataset(good_prefix)
    _expect_one_line(e, "good.bin", "truncated")


@pytest.mark.parametrize(
    "offset,data,needle",
    [(0, b"XXXXXXX", "magic"), (9, struct.pack("<Q", 2), "version 2"), (17, bytes([42]), "dtype code 42")],
)
def test_damaged_idx_header(good_prefix, offset, data, needle):
    _patch(good_prefix + ".idx", offset, data)
    with pytest.raises(DataError) as e:
        IndexedDataset(good_prefix)
    _expect_one_line(e, "good.idx", needle)


def test_idx_sizes_not_matching_bin(good_prefix):
    # Change one sequence length: the .bin no longer has the bytes the index promises.
    _patch(good_prefix + ".idx", 34 + 4 * 9, struct.pack("<i", 1000))
    with pytest.raises(DataError) as e:
        IndexedDataset(good_prefix)
    _expect_one_line(e, "good.idx", "sequence 9", "damaged")


def test_last_length_beyond_bin(good_prefix):
    n = IndexedDataset(good_prefix).index.sequence_count
    _patch(good_prefix + ".idx", 34 + 4 * (n - 1), struct.pack("<i", 1000))
    with pytest.raises(DataError) as e:
        IndexedDataset(good_prefix)
    _expect_one_line(e, "good.bin", "truncated")


def test_idx_count_not_matching_file(good_prefix):
    _patch(good_prefix + ".idx", 18, struct.pack("<Q", 11))
    with pytest.raises(DataError) as e:
        IndexedDataset(good_prefix)
    _expect_one_line(e, "good.idx", "damaged")


def test_dtype_change_detected(good_prefix):
    # int32 -> uint16 keeps a valid code, but the offsets then step by 4 bytes per 2-byte token.
    _patch(good_prefix + ".idx", 17, bytes([8]))
    with pytest.raises(DataError) as e:
        IndexedDataset(good_prefix)
    _expect_one_line(e, "good.idx", "damaged")
