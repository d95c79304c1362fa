"""Random access to the records of a JSONL file through a cached index of line offsets.

``JsonlIndex(path)`` finds where every non-empty line starts and ends, once: the offsets are written beside the
data as ``{file}.idx.npy`` (int64 ``[n + 1]`` starts, the last entry the file size) with ``{file}.idx.json``
holding the fingerprint of the file they describe (size, mtime and a hash of its first and last MiB). Every
later open — another run, another rank, a DataLoader worker — reads the cache instead of the file as long as
the fingerprint matches, so a 1 GB file starts in milliseconds after its first indexing (a few seconds:
offsets are found with numpy over memory-mapped chunks, in ``workers`` threads).

Indexing also parses every line once, so a damaged file stops the run before its first step: a line that
is not a JSON object is a one-line ``DataError`` naming the file, the 1-based line number and the reason. The
distinct key sets of the records (each with its first record) are kept with the cache, so the dataset checks
the keys its formatting needs without another pass.

The cache goes beside the data when that directory is writable, else under ``cache_dir`` (the dataset's
``path_to_cache``, else ``$LONGSPAN_CACHE`` or ``~/.cache/longspan``; see :func:`cache_directory_for`). It is
written atomically (temporary file + rename), so ranks that index at the same time cannot corrupt it. Records
are read lazily from a memory map; ``record(i)`` parses line ``i``.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

import numpy as np

from longspan.core.errors import DataError
from longspan.data.builtin import cache_root

#: bump when the cache layout changes (an old cache is then rebuilt)
INDEX_VERSION = 2
#: distinct key sets remembered per file; past this the keys of further sets are checked when records are read
MAX_KEY_SETS = 256
_PARSE_BLOCK = 4096  # lines parsed per call into the JSON parser (bounds the memory of the parsed records)
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


def is_writable_directory(directory: str) -> bool:
    """Whether files can be created in ``directory`` (access(2): permissions and read-only mounts; a write that
    still fails, e.g. on a squashed network mount, leaves the index uncached)."""
    return os.access(directory, os.W_OK | os.X_OK)


def cache_directory_for(data_dir: str, path_to_cache: Optional[str] = None) -> str:
    """Where the caches (line indexes, packs) of the files in ``data_dir`` go: ``data_dir`` itself when it is
    writable, else a folder named after it under ``path_to_cache`` (``$LONGSPAN_CACHE`` or ``~/.cache/longspan``
    when None)."""
    data_dir = os.path.abspath(data_dir)
    if is_writable_directory(data_dir):
        return data_dir
    tag = hashlib.sha1(data_dir.encode()).hexdigest()[:12]
    return os.path.join(path_to_cache or cache_root(), "sft", f"{os.path.basename(data_dir) or 'root'}-{tag}")


def _newlines(buf: Any, start: int, end: int) -> np.ndarray:
    view = np.frombuffer(buf, dtype=np.uint8, count=end - start, offset=start)
    return np.flatnonzero(view == 10).astype(np.int64) + start


class JsonlIndex:
    """Line index of one JSONL file (built once, cached beside it); ``len()`` records, ``record(i)`` parses one.

    Args:
        path: the ``.jsonl`` file.
        workers: threads that scan the file when the index is built (``dataset.memmap_workers``).
        cache_dir: where to write the cache; default :func:`cache_directory_for` the file's directory (no
            cache when that cannot be written either).
    """

    def __init__(self, path: str, workers: int = 1, cache_dir: str | None = None) -> None:
        if not os.path.isfile(path):
            raise DataError(f"data file {path} does not exist")
        self.path = path
        base = os.path.basename(path)
        directory = cache_dir or cache_directory_for(os.path.dirname(os.path.abspath(path)))
        self.index_file = os.path.join(directory, base + ".idx.npy")
        self.meta_file = os.path.join(directory, base + ".idx.json")
        fingerprint = file_fingerprint(path)
        self._file = None
        self._mm: mmap.mmap | None = None
        cached = self._load_cache(fingerprint)
        if cached is None:
            bounds, self.key_sets = self._build(workers)
            self._save_cache(bounds, {"fingerprint": fingerprint, "key_sets": self.key_sets})
        else:
            bounds, self.key_sets = cached
        self.starts, self.ends = bounds

    # ------------------------------------------------------------------------------------ cache

    def _load_cache(self, fingerprint: dict[str, Any]) -> tuple[tuple[np.ndarray, np.ndarray], list] | None:
        try:
            with open(self.meta_file) as f:
                meta = json.load(f)
            if not isinstance(meta, dict) or meta.get("fingerprint") != fingerprint:
                return None
            table = np.load(self.index_file, mmap_mode="r")
        except (OSError, ValueError):
            return None
        if table.ndim != 2 or table.shape[0] != 2:
            return None
        return (table[0], table[1]), [(list(keys), int(first)) for keys, first in meta.get("key_sets", [])]

    def _build(self, workers: int) -> tuple[tuple[np.ndarray, np.ndarray], list]:
        size = os.path.getsize(self.path)
        if size == 0:
            return (np.zeros(0, np.int64), np.zeros(0, np.int64)), []
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
            more_blank, key_sets = self._validate(mm, starts, ends, blank)
            blank += more_blank
        if blank:
            mask = np.ones(starts.size, bool)
            mask[blank] = False
            starts, ends = starts[mask], ends[mask]
        return (starts, ends), key_sets

    def _validate(self, mm: Any, starts: np.ndarray, ends: np.ndarray, blank: list) -> tuple[list, list]:
        """Parse every line (one pass, before any training): a line that is not a JSON object is a one-line
        DataError. Returns the whitespace-only lines found (not records) and the distinct key sets as
        [(keys, first record number)]."""
        skip = set(int(i) for i in blank)
        lines = [i for i in range(starts.size) if i not in skip] if skip else list(range(starts.size))
        starts_l, ends_l = starts.tolist(), ends.tolist()
        more_blank: list = []
        key_sets: dict[tuple, int] = {}
        for first in range(0, len(lines), _PARSE_BLOCK):
            block = lines[first:first + _PARSE_BLOCK]
            raws = [mm[starts_l[i]:ends_l[i]] for i in block]
            values = self._parse_block(mm, block, raws, starts_l, more_blank)
            for i, value in values:
                if len(key_sets) >= MAX_KEY_SETS:
                    break
                key_sets.setdefault(tuple(value), i)
        # record numbers once the blank lines are dropped
        dropped = np.sort(np.asarray(sorted(skip) + more_blank, dtype=np.int64))
        return more_blank, [(list(keys), int(i - np.searchsorted(dropped, i))) for keys, i in key_sets.items()]

    def _parse_block(self, mm: Any, block: list, raws: list, starts: list, more_blank: list) -> list:
        """[(line index, record)] of a block of lines, parsed as one JSON array (one call into the C parser
        per block); when that fails, line by line to find the bad line."""
        try:
            values = json.loads(b"[" + b",".join(raws) + b"]")
        except ValueError:
            values = None
        if values is not None and len(values) == len(block) and all(type(v) is dict for v in values):
            return list(zip(block, values))
        out = []
        for i, raw in zip(block, raws):
            try:
                value = json.loads(raw)
            except ValueError as exc:
                if not raw.strip():
                    more_blank.append(i)
                    continue
                line = mm[:starts[i]].count(b"\n") + 1
                raise DataError(f"{self.path} line {line}: not valid JSON ({str(exc).splitlines()[0]})") from None
            if type(value) is not dict:
                line = mm[:starts[i]].count(b"\n") + 1
                raise DataError(f"{self.path} line {line}: expected a JSON object, got {type(value).__name__}")
            out.append((i, value))
        return out

    def _save_cache(self, bounds: tuple[np.ndarray, np.ndarray], meta: dict[str, Any]) -> None:
        tmp_suffix = f".tmp{os.getpid()}"
        try:
            os.makedirs(os.path.dirname(self.index_file), exist_ok=True)
            with open(self.index_file + tmp_suffix, "wb") as f:
                np.save(f, np.stack(bounds))
            os.replace(self.index_file + tmp_suffix, self.index_file)
            with open(self.meta_file + tmp_suffix, "w") as f:
                json.dump(meta, f)
            os.replace(self.meta_file + tmp_suffix, self.meta_file)
        except OSError:  # no writable cache directory either: work without a cache
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
