"""Megatron's indexed dataset: a ``.bin`` of tokens back to back and an ``.idx`` that indexes it.

The on-disk format is megatron-core's, so preprocessed corpora move between the two unchanged:

``.idx`` (little-endian): magic ``MMIDIDX\\x00\\x00`` | version uint64 = 1 | dtype code uint8 | sequence count S
uint64 | document-index length D uint64 | S int32 sequence lengths | S int64 byte offsets into ``.bin`` | D int64
document index (sequence boundaries of the documents, starting at 0) | S int8 sequence modes (multimodal only).

Damaged files raise :class:`~longspan.core.errors.DataError` naming the file, instead of failing later with an
index error deep inside a data loader worker.
"""

from __future__ import annotations

import os
import shutil
import struct
from array import array
from enum import Enum
from typing import Iterable, Optional, Sequence, Union

import numpy as np
import torch

from longspan.core.errors import DataError
from longspan.core.logging import get_logger

logger = get_logger(__name__)

INDEX_HEADER = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
_HEADER_BYTES = len(INDEX_HEADER) + 8 + 1 + 8 + 8  # = 34


class DType(Enum):
    """The dtype codes of the ``.idx`` header (megatron-core's numbering)."""

    uint8 = 1
    int8 = 2
    int16 = 3
    int32 = 4
    int64 = 5
    float64 = 6
    float32 = 7
    uint16 = 8

    @classmethod
    def code_from_dtype(cls, dtype: Union[type, np.dtype]) -> int:
        """The header code for a numpy dtype (``np.uint16`` -> 8)."""
        name = np.dtype(dtype).name
        if name not in cls.__members__:
            valid = ", ".join(cls.__members__)
            raise DataError(f"token dtype {name} cannot be stored in an .idx file; valid: {valid}")
        return cls[name].value

    @classmethod
    def dtype_from_code(cls, code: int) -> type:
        """The numpy dtype for a header code (8 -> ``np.uint16``)."""
        return getattr(np, cls(code).name)

    @staticmethod
    def size(key: Union[int, type, np.dtype]) -> int:
        """Item size in bytes of a dtype or dtype code."""
        if isinstance(key, int):
            return np.dtype(DType.dtype_from_code(key)).itemsize
        return np.dtype(key).itemsize

    @staticmethod
    def optimal_dtype(cardinality: Optional[int]) -> type:
        """The token dtype preprocessing uses for a vocabulary of this size (uint16 below 65500)."""
        if cardinality is not None and cardinality < 65500:
            return np.uint16
        return np.int32


def get_idx_path(path_prefix: str) -> str:
    """``{prefix}.idx``"""
    return path_prefix + ".idx"


def get_bin_path(path_prefix: str) -> str:
    """``{prefix}.bin``"""
    return path_prefix + ".bin"


class _Index:
    """The parsed ``.idx`` file: memory-mapped arrays of lengths, pointers, document index and modes."""

    def __init__(self, idx_path: str, multimodal: bool) -> None:
        self.path = idx_path
        try:
            file_size = os.path.getsize(idx_path)
            with open(idx_path, "rb") as stream:
                header = stream.read(_HEADER_BYTES)
        except OSError as exc:
            raise DataError(f"cannot read index file {idx_path}: {exc.strerror}") from None
        if len(header) < _HEADER_BYTES or header[:9] != INDEX_HEADER:
            raise DataError(
                f"{idx_path} is not a Megatron index file: magic {header[:9]!r}, expected {INDEX_HEADER!r}"
            )
        (version,) = struct.unpack("<Q", header[9:17])
        if version != INDEX_VERSION:
            raise DataError(f"{idx_path} has index version {version}; only version {INDEX_VERSION} is supported")
        code = header[17]
        if code not in {d.value for d in DType}:
            raise DataError(f"{idx_path} has dtype code {code}; valid codes are 1-8 (see megatron-core DType)")
        self.dtype = DType.dtype_from_code(code)
        self.dtype_size = DType.size(code)
        self.sequence_count, self.document_count = struct.unpack("<QQ", header[18:34])
        s, d = self.sequence_count, self.document_count
        expected = _HEADER_BYTES + 4 * s + 8 * s + 8 * d
        # A text reader may open a multimodal file (the trailing modes are then ignored).
        allowed = (expected + s,) if multimodal else (expected, expected + s)
        if file_size not in allowed:
            raise DataError(
                f"{idx_path} is {file_size} bytes but its header ({s} sequences, {d} document-index entries"
                f"{', multimodal' if multimodal else ''}) needs {allowed[0]} bytes: the file is damaged"
            )
        self._mmap = np.memmap(idx_path, mode="r", dtype=np.uint8)
        offset = _HEADER_BYTES
        self.sequence_lengths = np.frombuffer(self._mmap, dtype=np.int32, count=s, offset=offset)
        offset += 4 * s
        self.sequence_pointers = np.frombuffer(self._mmap, dtype=np.int64, count=s, offset=offset)
        offset += 8 * s
        self.document_indices = np.frombuffer(self._mmap, dtype=np.int64, count=d, offset=offset)
        offset += 8 * d
        self.sequence_modes = (
            np.frombuffer(self._mmap, dtype=np.int8, count=s, offset=offset) if multimodal else None
        )
        if d < 1 or self.document_indices[0] != 0 or self.document_indices[-1] != s:
            raise DataError(
                f"{idx_path} has a document index that does not span its {s} sequences "
                f"(first {self.document_indices[0] if d else None}, last {self.document_indices[-1] if d else None})"
            )

    def check_consistent(self) -> None:
        """Every sequence must start where the previous one ends (catches a damaged length or pointer)."""
        step = 1 << 24  # chunks bound the temporary memory on indexes of billions of sequences
        lengths, pointers = self.sequence_lengths, self.sequence_pointers
        for beg in range(0, self.sequence_count, step):
            end = min(beg + step + 1, self.sequence_count)
            lens = lengths[beg:end].astype(np.int64)
            gaps = np.diff(pointers[beg:end]) - lens[:-1] * self.dtype_size
            bad = np.flatnonzero((gaps != 0) | (lens[:-1] < 0))
            if len(bad) or (beg == 0 and self.sequence_count and pointers[0] != 0):
                at = beg + (int(bad[0]) if len(bad) else 0)
                raise DataError(
                    f"{self.path}: sequence {at} (length {int(lengths[at])}, offset {int(pointers[at])}) does not "
                    f"end where sequence {at + 1} starts: the index is damaged"
                )

    def expected_bin_bytes(self) -> int:
        if self.sequence_count == 0:
            return 0
        return int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype_size


class IndexedDataset(torch.utils.data.Dataset):
    """Reader of a ``.bin``/``.idx`` pair (megatron-core's ``IndexedDataset`` API).

    Args:
        path_prefix: the path without ``.bin``/``.idx``.
        multimodal: whether the index carries one mode per sequence; items are then ``(tokens, mode)``.
        mmap: memory-map the ``.bin`` file; False reads each item with file I/O (for file systems where
            mmap is slow or unavailable).
    """

    def __init__(self, path_prefix: str, multimodal: bool = False, mmap: bool = True) -> None:
        super().__init__()
        self._open(path_prefix, multimodal, mmap)

    def _open(self, path_prefix: str, multimodal: bool, mmap: bool) -> None:
        self.path_prefix = path_prefix
        self.multimodal = multimodal
        self.mmap = mmap
        idx_path, bin_path = get_idx_path(path_prefix), get_bin_path(path_prefix)
        missing = [p for p in (idx_path, bin_path) if not os.path.isfile(p)]
        if missing:
            raise DataError(
                f"data prefix {path_prefix!r}: {' and '.join(missing)} not found "
                f"(a prefix names a {os.path.basename(path_prefix)}.bin/.idx pair)"
            )
        self.index = _Index(idx_path, multimodal)
        self.index.check_consistent()
        bin_size = os.path.getsize(bin_path)
        expected = self.index.expected_bin_bytes()
        if bin_size != expected:
            raise DataError(
                f"{bin_path} is {bin_size} bytes but {idx_path} indexes {expected} bytes: "
                f"the .bin is {'truncated' if bin_size < expected else 'longer than its index'}"
            )
        self._bin_file = None
        self._bin_mmap = None
        if mmap:
            # np.memmap refuses empty files; an empty dataset needs no buffer.
            self._bin_mmap = np.memmap(bin_path, mode="r", dtype=np.uint8) if bin_size else np.zeros(0, np.uint8)
        else:
            self._bin_file = open(bin_path, "rb")

    def __getstate__(self) -> tuple:
        # Data loader workers reopen the files instead of pickling the maps.
        return (self.path_prefix, self.multimodal, self.mmap)

    def __setstate__(self, state: tuple) -> None:
        self._open(*state)

    def __del__(self) -> None:
        if getattr(self, "_bin_file", None) is not None:
            self._bin_file.close()

    def _read(self, count: int, byte_offset: int) -> np.ndarray:
        dtype = self.index.dtype
        if self._bin_mmap is not None:
            return np.frombuffer(self._bin_mmap, dtype=dtype, count=count, offset=byte_offset)
        out = np.empty(count, dtype=dtype)
        self._bin_file.seek(byte_offset)
        self._bin_file.readinto(memoryview(out).cast("B"))
        return out

    def __len__(self) -> int:
        """Number of sequences."""
        return self.index.sequence_count

    def __getitem__(self, idx: Union[int, np.integer, slice]):
        """Sequence ``idx`` (with its mode when multimodal), or a list of sequences for a contiguous slice."""
        if isinstance(idx, (int, np.integer)):
            idx = int(idx)
            if idx < 0:
                idx += len(self)
            seq = self._read(int(self.index.sequence_lengths[idx]), int(self.index.sequence_pointers[idx]))
            if self.multimodal:
                return seq, self.index.sequence_modes[idx]
            return seq
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError("slices into an IndexedDataset must be contiguous")
            lengths = self.index.sequence_lengths[start:stop]
            if len(lengths) == 0:
                seqs: list = []
            else:
                flat = self._read(int(lengths.sum()), int(self.index.sequence_pointers[start]))
                seqs = np.split(flat, np.cumsum(lengths)[:-1])
            if self.multimodal:
                return seqs, self.index.sequence_modes[start:stop]
            return seqs
        raise TypeError(f"unexpected index type {type(idx).__name__}")

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None):
        """Tokens ``[offset, offset + length)`` of sequence ``idx`` (to its end when length is None)."""
        idx = int(idx)
        seq_len = int(self.index.sequence_lengths[idx])
        if length is None:
            length = seq_len - offset
        ptr = int(self.index.sequence_pointers[idx]) + int(offset) * self.index.dtype_size
        seq = self._read(int(length), ptr)
        if self.multimodal:
            return seq, self.index.sequence_modes[idx]
        return seq

    @property
    def dtype(self) -> type:
        """The token dtype of the ``.bin`` file."""
        return self.index.dtype

    @property
    def sequence_lengths(self) -> np.ndarray:
        """int32 length of every sequence."""
        return self.index.sequence_lengths

    @property
    def sequence_pointers(self) -> np.ndarray:
        """int64 byte offset of every sequence in the ``.bin`` file."""
        return self.index.sequence_pointers

    @property
    def document_indices(self) -> np.ndarray:
        """int64 sequence boundaries of the documents (``[0, ..., len(self)]``)."""
        return self.index.document_indices

    @property
    def sequence_modes(self) -> Optional[np.ndarray]:
        """int8 mode of every sequence (multimodal datasets only)."""
        return self.index.sequence_modes

    @staticmethod
    def exists(path_prefix: str) -> bool:
        """Whether both ``{prefix}.bin`` and ``{prefix}.idx`` exist."""
        return os.path.isfile(get_idx_path(path_prefix)) and os.path.isfile(get_bin_path(path_prefix))


def write_index(
    idx_path: str,
    dtype: type,
    sequence_lengths: Sequence[int],
    document_indices: Sequence[int],
    sequence_modes: Optional[Sequence[int]] = None,
) -> None:
    """Write an ``.idx`` file for sequences stored back to back (pointers are the running byte sums)."""
    lengths = np.asarray(sequence_lengths, dtype=np.int32)
    pointers = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1].astype(np.int64) * DType.size(dtype), out=pointers[1:])
    with open(idx_path, "wb") as out:
        out.write(INDEX_HEADER)
        out.write(struct.pack("<Q", INDEX_VERSION))
        out.write(struct.pack("<B", DType.code_from_dtype(dtype)))
        out.write(struct.pack("<Q", len(lengths)))
        out.write(struct.pack("<Q", len(document_indices)))
        out.write(lengths.tobytes(order="C"))
        out.write(pointers.tobytes(order="C"))
        out.write(np.asarray(document_indices, dtype=np.int64).tobytes(order="C"))
        if sequence_modes is not None:
            out.write(np.asarray(sequence_modes, dtype=np.int8).tobytes(order="C"))


def _as_numpy(data: Union[torch.Tensor, np.ndarray, Iterable[int]], dtype: type) -> np.ndarray:
    if isinstance(data, torch.Tensor):
        data = data.detach().cpu().numpy()
    return np.asarray(data, dtype=dtype)


class IndexedDatasetBuilder:
    """Writer of a ``.bin``/``.idx`` pair (megatron-core's ``IndexedDatasetBuilder`` API).

    Args:
        bin_path: the ``.bin`` file to write.
        dtype: token dtype (``DType.optimal_dtype(vocab_size)`` is what preprocessing uses).
        multimodal: store one int8 mode per sequence.
    """

    def __init__(self, bin_path: str, dtype: type = np.int32, multimodal: bool = False) -> None:
        self.bin_path = bin_path
        self.dtype = dtype
        self.multimodal = multimodal
        DType.code_from_dtype(dtype)  # reject dtypes the header cannot name before writing anything
        self.data_file = open(bin_path, "wb")
        # array('q') keeps millions of entries compact and appends at C speed.
        self.sequence_lengths = array("q")
        self.document_indices = array("q", [0])
        self.sequence_modes: Optional[array] = array("b") if multimodal else None

    def add_item(self, tensor: Union[torch.Tensor, np.ndarray, Iterable[int]], mode: int = 0) -> None:
        """Append one sequence (the document stays open until :meth:`end_document`)."""
        arr = _as_numpy(tensor, self.dtype)
        self.data_file.write(arr.tobytes(order="C"))
        self.sequence_lengths.append(arr.size)
        if self.sequence_modes is not None:
            self.sequence_modes.append(mode)

    def add_document(
        self,
        tensor: Union[torch.Tensor, np.ndarray, Iterable[int]],
        lengths: Sequence[int],
        modes: Optional[Sequence[int]] = None,
    ) -> None:
        """Append one whole document made of sequences of the given ``lengths``."""
        arr = _as_numpy(tensor, self.dtype)
        if int(sum(lengths)) != arr.size:
            raise DataError(f"add_document: lengths sum to {int(sum(lengths))} but the document has {arr.size} tokens")
        self.data_file.write(arr.tobytes(order="C"))
        self.sequence_lengths.extend(int(x) for x in lengths)
        self.document_indices.append(len(self.sequence_lengths))
        if self.sequence_modes is not None:
            self.sequence_modes.extend(int(m) for m in (modes if modes is not None else [0] * len(lengths)))

    def end_document(self) -> None:
        """Close the current document (after one or more :meth:`add_item` calls)."""
        self.document_indices.append(len(self.sequence_lengths))

    def add_index(self, path_prefix: str) -> None:
        """Append every document of another ``.bin``/``.idx`` pair of the same dtype."""
        other = _Index(get_idx_path(path_prefix), self.multimodal)
        if np.dtype(other.dtype) != np.dtype(self.dtype):
            raise DataError(
                f"{get_idx_path(path_prefix)} holds {np.dtype(other.dtype).name} tokens; this builder writes "
                f"{np.dtype(self.dtype).name}"
            )
        offset = len(self.sequence_lengths)
        self.sequence_lengths.extend(other.sequence_lengths.astype(np.int64).tolist())
        self.document_indices.extend((other.document_indices[1:] + offset).tolist())
        if self.sequence_modes is not None:
            self.sequence_modes.extend(other.sequence_modes.tolist())
        del other
        with open(get_bin_path(path_prefix), "rb") as src:
            shutil.copyfileobj(src, self.data_file)

    def finalize(self, idx_path: str) -> None:
        """Close the ``.bin`` file and write the ``.idx`` file."""
        self.data_file.close()
        write_index(
            idx_path,
            self.dtype,
            np.asarray(self.sequence_lengths, dtype=np.int64),
            np.asarray(self.document_indices, dtype=np.int64),
            np.asarray(self.sequence_modes, dtype=np.int8) if self.sequence_modes is not None else None,
        )
