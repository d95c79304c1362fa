"""Reading slices of HF safetensors checkpoints and writing them one tensor at a time.

``HFCheckpointReader`` opens ``model.safetensors`` or the shards listed in ``model.safetensors.index.json``
lazily and reads only the rows/columns asked for (``safe_open(...).get_slice``), so a tensor-parallel rank
never loads a whole matrix. Each file's header is checked against its size first: a truncated download is
one ``CheckpointError`` naming the file, not a crash halfway through the load.

``StreamingSafetensorsWriter`` writes tensors as they come (data to a scratch file, header at the end), so
exporting holds one tensor in memory at a time; it starts a new shard past ``max_shard_bytes``.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from longspan.core.errors import CheckpointError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_ST_DTYPES = {
    torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}


def _read_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file, after checking the file holds all the data it announces."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            raw = fh.read(8)
            if len(raw) < 8:
                raise CheckpointError(f"{path} is truncated or not a safetensors file ({size} bytes)")
            (header_len,) = struct.unpack("<Q", raw)
            if header_len > size - 8:
                raise CheckpointError(f"{path} is truncated: its header needs {header_len} bytes, the file has {size}")
            header = json.loads(fh.read(header_len))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} cannot be read as safetensors ({exc})") from None
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + header_len + end > size:
        raise CheckpointError(
            f"{path} is truncated: it holds {size} bytes but its tensors need {8 + header_len + end}"
        )
    return header


class HFCheckpointReader:
    """Tensor names, shapes and slices of an HF model directory's safetensors files."""

    def __init__(self, directory: str | os.PathLike, prefix_aliases: tuple[tuple[str, str], ...] = ()) -> None:
        self.directory = Path(directory)
        # (prefix, other spelling): a missing ``prefix...`` tensor is looked up as ``other spelling...``
        self.prefix_aliases = tuple(prefix_aliases)
        index = self.directory / INDEX_FILE
        single = self.directory / SINGLE_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError) as exc:
                raise CheckpointError(f"{index} is not a valid safetensors index ({exc})") from None
            self.files = {name: self.directory / file for name, file in weight_map.items()}
        elif single.is_file():
            self.files = {}
            for name in _read_header(single):
                if name != "__metadata__":
                    self.files[name] = single
        else:
            raise CheckpointError(f"{self.directory} holds no {SINGLE_FILE} or {INDEX_FILE}")
        self._headers: dict[Path, dict[str, Any]] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def _header(self, path: Path) -> dict[str, Any]:
        if path not in self._headers:
            if not path.is_file():
                raise CheckpointError(f"{path} is missing (listed in {INDEX_FILE})")
            self._headers[path] = _read_header(path)
        return self._headers[path]

    def _resolve(self, name: str) -> str:
        """``name``, or the same tensor saved from the base model without its prefix (GPT-2's ``h.0...``
        for ``transformer.h.0...``, ``layers.0...`` for ``model.layers.0...``)."""
        if name not in self.files:
            for prefix, alias in self.prefix_aliases:
                if name.startswith(prefix) and alias + name[len(prefix):] in self.files:
                    return alias + name[len(prefix):]
        if name not in self.files and "." in name:
            bare = name.split(".", 1)[1]
            if bare in self.files:
                return bare
        return name

    def _path(self, name: str) -> Path:
        path = self.files.get(name)
        if path is None:
            raise CheckpointError(f"{self.directory} has no tensor {name} that the model needs")
        return path

    def shape(self, name: str) -> tuple[int, ...]:
        """The full shape of tensor ``name``."""
        name = self._resolve(name)
        path = self._path(name)
        entry = self._header(path).get(name)
        if entry is None:
            raise CheckpointError(f"{path} does not hold {name} (its index says it does)")
        return tuple(entry["shape"])

    def dtype_name(self, name: str) -> str:
        """The safetensors dtype string (``BF16``, ``F32``, ...) of tensor ``name``."""
        name = self._resolve(name)
        return self._header(self._path(name))[name]["dtype"]

    def read(self, name: str, box: tuple[slice, ...] | None = None) -> torch.Tensor:
        """Tensor ``name``, or only the part ``box`` (one slice per dimension) of it."""
        name = self._resolve(name)
        path = self._path(name)
        scalar = self.shape(name) == ()  # validates the file first
        try:
            # Opened per read and closed right after: the file's memory map is released, so the pages read
            # do not stay resident for the whole load (the returned tensor is a copy).
            with safe_open(str(path), framework="pt") as handle:
                if scalar:  # a 0-d tensor has no slice to take
                    return handle.get_tensor(name)
                view = handle.get_slice(name)
                return view[box] if box is not None and len(box) else view[:]
        except SafetensorError as exc:
            raise CheckpointError(f"{path}: cannot read {name} ({exc})") from None

    def close(self) -> None:
        """Nothing stays open between reads; kept for callers that close readers."""


class StreamingSafetensorsWriter:
    """Write ``(name, tensor)`` pairs into safetensors shards without holding more than one tensor.

    Shards are named ``{prefix}-{k}.safetensors`` while writing; ``finish()`` returns ``{name: file}``.
    """

    def __init__(self, directory: str | os.PathLike, prefix: str = "model", max_shard_bytes: int = 5 * 2**30) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.prefix = prefix
        self.max_shard_bytes = max_shard_bytes
        self.weight_map: dict[str, str] = {}
        self.files: list[str] = []
        self.total_bytes = 0
        self._data: Any = None
        self._entries: dict[str, Any] = {}
        self._offset = 0

    def _open_shard(self) -> None:
        name = f"{self.prefix}-{len(self.files) + 1}.safetensors"
        self.files.append(name)
        self._data = open(self.directory / (name + ".data"), "wb")
        self._entries = {"__metadata__": {"format": "pt"}}
        self._offset = 0

    def _close_shard(self) -> None:
        if self._data is None:
            return
        self._data.close()
        name = self.files[-1]
        header = json.dumps(self._entries, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)  # 8-byte alignment of the data, as safetensors writes it
        data_path = self.directory / (name + ".data")
        with open(self.directory / name, "wb") as out, open(data_path, "rb") as data:
            out.write(struct.pack("<Q", len(header)))
            out.write(header)
            while chunk := data.read(64 * 2**20):
                out.write(chunk)
        data_path.unlink()
        self._data = None

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Append one tensor (moved to the CPU, made contiguous)."""
        if name in self.weight_map:
            raise ValueError(f"tensor {name} written twice")
        tensor = tensor.detach().to("cpu").contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if self._data is None or (self._offset and self._offset + nbytes > self.max_shard_bytes):
            self._close_shard()
            self._open_shard()
        if tensor.dtype not in _ST_DTYPES:
            raise ValueError(f"tensor {name}: dtype {tensor.dtype} cannot be stored in safetensors")
        self._data.write(tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if nbytes else b"")
        self._entries[name] = {"dtype": _ST_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                               "data_offsets": [self._offset, self._offset + nbytes]}
        self._offset += nbytes
        self.total_bytes += nbytes
        self.weight_map[name] = self.files[-1]

    def finish(self) -> dict[str, str]:
        """Close the last shard; the tensor -> file map."""
        self._close_shard()
        return dict(self.weight_map)


def finalize_shards(directory: str | os.PathLike, weight_map: dict[str, str], total_bytes: int) -> None:
    """Give the shards HF's names (``model.safetensors`` or ``model-0000k-of-0000n.safetensors`` + index)."""
    directory = Path(directory)
    files = sorted(set(weight_map.values()), key=lambda f: (f.rsplit("-", 1)[0], int(f.rsplit("-", 1)[1].split(".")[0])))
    if len(files) == 1:
        renames = {files[0]: SINGLE_FILE}
    else:
        renames = {f: f"model-{k + 1:05d}-of-{len(files):05d}.safetensors" for k, f in enumerate(files)}
    for old, new in renames.items():
        os.replace(directory / old, directory / new)
    stale = directory / INDEX_FILE
    if len(files) == 1:
        if stale.exists():
            stale.unlink()
        return
    index = {"metadata": {"total_size": total_bytes},
             "weight_map": {name: renames[f] for name, f in sorted(weight_map.items())}}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
