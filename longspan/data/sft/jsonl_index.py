"""Random access to the records of a JSONL file through a cached index of line offsets.

``JsonlIndex(path)`` finds where every non-empty line starts and ends, once: the offsets are written beside the
data as ``{file}.idx.npy`` (int64 ``[n + 1]`` starts, the last entry the file size) with ``{file}.idx.json``
holding the fingerprint of the file they describe (size, mtime and a hash of its first and last MiB). Every
later open — another run, another rank, a DataLoader worker — reads the cache instead of the file as long as
the fingerprint matches, so a 1 GB file starts in milliseconds after its first indexing (a few seconds:
offsets are found with numpy over memory-mapped chunks, in ``workers`` threads).

The cache is written atomically (temporary file + rename), so ranks that index at the same time cannot
corrupt it. Records are read lazily from a memory map; ``record(i)`` parses line ``i`` and raises a one-line
``DataError`` naming the file and the 1-based line number when it is not a JSON object.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from longspan.core.errors import DataError

#: bump when the cache layout changes (an old cache is then rebuilt)
INDEX_VERSION = 1
_CHUNK = 64 << 20  # bytes per indexing chunk
_HASH_SPAN = 1 << 20


def file_fingerprint(path: str) -> dict[str, Any]:
    """Size, mtime and a hash of the first and last MiB: changes whenever the file is replaced or edited."""
    st = os.stat(path)
    h = hashlib.sha1()
    with open(path, "rb") as f:
        h.update(f.read(_HASH_SPAN))
        if st.st_size > _HASH_SPAN:
            f.seek(max(_HASH_SPAN, st.st_size - _HASH_SPAN))
            h.update(f.read(_HASH_SPAN))
    return {"version": INDEX_VERSION, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha1_ends": h.hexdigest()}


def _newlines(buf: Any, start: int, end: int) -> np.ndarray:
    view = np.frombuffer(buf, dtype=np.uint8, count=end - start, offset=start)
    return np.flatnonzero(view == 10).astype(np.int64) + start


class JsonlIndex:
    """Line index of one JSONL file (built once, cached beside it); ``len()`` records, ``record(i)`` parses one.

    Args:
        path: the ``.jsonl`` file.
        workers: threads that scan the file when the index is built (``dataset.memmap_workers``).
        cache_dir: where to write the cache; default beside the file (falls back to no cache when that
            directory is read-only).
    """

    def __init__(self, path: str, workers: int = 1, cache_dir: str | None = None) -> None:
        if not os.path.isfile(path):
            raise DataError(f"data file {path} does not exist")
        self.path = path
        base = os.path.basename(path)
        directory = cache_dir or os.path.dirname(os.path.abspath(path))
        self.index_file = os.path.join(directory, base + ".idx.npy")
        self.meta_file = os.path.join(directory, base + ".idx.json")
        fingerprint = file_fingerprint(path)
        bounds = self._load_cache(fingerprint)
        if bounds is None:
            bounds = self._build(workers)
            self._save_cache(bounds, fingerprint)
        self.starts, self.ends = bounds
        self._file = None
        self._mm: mmap.mmap | None = None

    # ------------------------------------------------------------------------------------ cache

    def _load_cache(self, fingerprint: dict[str, Any]) -> tuple[np.ndarray, np.ndarray] | None:
        try:
            with open(self.meta_file) as f:
                if json.load(f) != fingerprint:
                    return None
            table = np.load(self.index_file, mmap_mode="r")
        except (OSError, ValueError):
            return None
        if table.ndim != 2 or table.shape[0] != 2:
            return None
        return table[0], table[1]

    def _build(self, workers: int) -> tuple[np.ndarray, np.ndarray]:
        size = os.path.getsize(self.path)
        if size == 0:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        with open(self.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            spans = [(s, min(s + _CHUNK, size)) for s in range(0, size, _CHUNK)]
            with ThreadPoolExecutor(max(1, int(workers))) as pool:
                parts = list(pool.map(lambda se: _newlines(mm, *se), spans))
            newlines = np.concatenate(parts)
            starts = np.concatenate([np.zeros(1, np.int64), newlines + 1])
            ends = np.concatenate([newlines, np.array([size], np.int64)])
            keep = ends > starts
            starts, ends = starts[keep], ends[keep]
            short = np.flatnonzero(ends - starts <= 2)  # '\r' or blank-ish lines are not records
            blank = [i for i in short if not mm[int(starts[i]):int(ends[i])].strip()]
        if blank:
            mask = np.ones(starts.size, bool)
            mask[blank] = False
            starts, ends = starts[mask], ends[mask]
        return starts, ends

    def _save_cache(self, bounds: tuple[np.ndarray, np.ndarray], fingerprint: dict[str, Any]) -> None:
        tmp_suffix = f".tmp{os.getpid()}"
        try:
            with open(self.index_file + tmp_suffix, "wb") as f:
                np.save(f, np.stack(bounds))
            os.replace(self.index_file + tmp_suffix, self.index_file)
            with open(self.meta_file + tmp_suffix, "w") as f:
                json.dump(fingerprint, f)
            os.replace(self.meta_file + tmp_suffix, self.meta_file)
        except OSError:  # a read-only data directory: work without a cache
            for name in (self.index_file + tmp_suffix, self.meta_file + tmp_suffix):
                if os.path.exists(name):
                    os.remove(name)

    # ---------------------------------------------------------------------------------- records

    def __len__(self) -> int:
        return int(self.starts.shape[0])

    def __getstate__(self) -> dict[str, Any]:  # DataLoader workers reopen the memory map
        state = dict(self.__dict__)
        state["_file"] = state["_mm"] = None
        return state

    def line_number(self, i: int) -> int:
        """1-based line number of record ``i`` in the file (blank lines are skipped by the index)."""
        if self._mm is None:
            self._open()
        return int(self._mm[: int(self.starts[i])].count(b"\n")) + 1

    def _open(self) -> None:
        self._file = open(self.path, "rb")
        self._mm = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ) if os.path.getsize(self.path) else b""

    def raw(self, i: int) -> bytes:
        """The bytes of record ``i``."""
        if self._mm is None:
            self._open()
        return self._mm[int(self.starts[i]):int(self.ends[i])]

    def record(self, i: int) -> dict[str, Any]:
        """Record ``i`` parsed; a one-line ``DataError`` (file, line number) when it is not a JSON object."""
        if not 0 <= i < len(self):
            raise IndexError(f"record {i} of {len(self)} in {self.path}")
        try:
            value = json.loads(self.raw(i))
        except ValueError as exc:
            msg = str(exc).splitlines()[0]
            raise DataError(f"{self.path} line {self.line_number(i)}: not valid JSON ({msg})") from None
        if not isinstance(value, dict):
            raise DataError(
                f"{self.path} line {self.line_number(i)}: expected a JSON object, got {type(value).__name__}"
            )
        return value
