"""Reading checkpoint files so that a damaged or foreign file is one ``CheckpointError`` naming it.

DCP checkpoints are pickles: ``.metadata`` is a pickled ``Metadata`` object and every tensor in the
``.distcp`` shards is a ``torch.save`` record. A pickle can run code when it is loaded, so load only
checkpoints you trust. Within that, longspan narrows what a file can do:

- ``.metadata`` is read with an unpickler that accepts only the classes a DCP checkpoint holds (the
  ``torch.distributed.checkpoint`` metadata dataclasses, ``torch.Size``, dtypes, paths), not arbitrary
  callables;
- tensors in the shards are read by DCP with ``torch.load(weights_only=True)``;
- ``train_state.pt`` is read with ``torch.load(weights_only=True)``;
- ``run_config.yaml`` goes through the same allow-list of ``_target_`` names as any YAML config.

Every read below turns the failure (missing file, random bytes, a truncated shard, unexpected content)
into one line naming the file and what is wrong.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import sys
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from longspan.core.errors import CheckpointError, LongspanError

METADATA_FILENAME = ".metadata"
TRAIN_STATE_FILENAME = "train_state.pt"


def _first_line(exc: BaseException) -> str:
    failures = getattr(exc, "failures", None)  # DCP's CheckpointException: rank -> wrapped exception
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        exc = getattr(inner, "exc", inner)
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__


@contextlib.contextmanager
def reading(path: Path, what: str) -> Iterator[None]:
    """Turn any failure while reading ``path`` (the ``what``) into one CheckpointError naming the file."""
    try:
        yield
    except LongspanError:
        raise
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} ({what}) is missing: the checkpoint is incomplete") from None
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - a failed read is a damaged file, not a bug
        raise CheckpointError(
            f"checkpoint file {path} ({what}) cannot be read ({_first_line(exc)}): the file is damaged; "
            "load another checkpoint (checkpoint.ckpt_step) or start fresh (checkpoint.load=null)"
        ) from exc


# Globals a DCP .metadata pickle refers to; anything else is refused before it is called.
_METADATA_MODULE_PREFIX = "torch.distributed.checkpoint."
_ALLOWED_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata: its own dataclasses and plain values, never an arbitrary callable."""

    def find_class(self, module: str, name: str) -> Any:
        if module.startswith(_METADATA_MODULE_PREFIX):
            value = super().find_class(module, name)
            if isinstance(value, type):
                return value
        elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        elif (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it refers to {module}.{name}, which DCP metadata never holds")


@contextlib.contextmanager
def _unraisable_collected() -> Iterator[list[Any]]:
    # A pickle of random bytes can make CPython report an error from a finalizer ("deallocated bytearray
    # object has exported buffers") on stderr, besides the exception the load raises: keep that line off
    # the terminal, the load's own error names the file.
    collected: list[Any] = []
    previous = sys.unraisablehook
    sys.unraisablehook = collected.append
    try:
        yield collected
    finally:
        sys.unraisablehook = previous


def _unpickle_metadata(payload: bytes) -> Any:
    # DCP writes .metadata with pickle protocol >= 2, whose stream starts with the PROTO opcode.
    if not payload.startswith(pickle.PROTO):
        raise pickle.UnpicklingError("it is not a pickle (DCP metadata starts with the pickle PROTO opcode)")
    with _unraisable_collected():
        return _MetadataUnpickler(io.BytesIO(payload)).load()


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with ``.metadata`` read by the allow-listing unpickler and errors naming the file."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        path = Path(self._get_metadata_path(rank))
        with reading(path, "DCP metadata"):
            metadata = _unpickle_metadata(path.read_bytes())
            if not isinstance(metadata, Metadata):
                raise pickle.UnpicklingError(f"it holds a {type(metadata).__name__}, not DCP Metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def read_metadata(directory: Path) -> Metadata:
    """The checkpoint's DCP metadata, after checking that every shard file it points into is complete."""
    metadata = SafeFileSystemReader(str(directory)).read_metadata()
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        relative = getattr(info, "relative_path", None)
        if relative is not None:
            needed[relative] = max(needed.get(relative, 0), int(info.offset) + int(info.length))
    for relative, size in sorted(needed.items()):
        shard = directory / relative
        if not shard.is_file():
            raise CheckpointError(f"checkpoint file {shard} (a DCP shard) is missing: the checkpoint is incomplete")
        actual = shard.stat().st_size
        if actual < size:
            raise CheckpointError(
                f"checkpoint file {shard} (a DCP shard) is truncated: {actual} bytes, the metadata needs {size}; "
                "load another checkpoint (checkpoint.ckpt_step) or start fresh (checkpoint.load=null)"
            )
    return metadata


def load_shards(state_dict: dict[str, Any], directory: Path, *, no_dist: bool) -> None:
    """``dcp.load`` into ``state_dict`` in place, through the safe reader; a damaged shard names the directory."""
    with reading(directory, "DCP shards"):
        dcp.load(state_dict, storage_reader=SafeFileSystemReader(str(directory)), no_dist=no_dist)


def load_weights_only(path: Path, what: str) -> Any:
    """``torch.load(path, weights_only=True)`` (tensors and plain containers only), errors naming the file."""
    with reading(path, what):
        return torch.load(path, weights_only=True, map_location="cpu")


@contextlib.contextmanager
def single_process_quiet() -> Iterator[None]:
    """DCP warns on every single-process save/load that it assumes one process; that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def iteration_from_dir(directory: Path) -> int:
    """The step a checkpoint directory was saved at (its ``train_state.pt``); 0 when it has none."""
    train_state_file = directory / TRAIN_STATE_FILENAME
    if train_state_file.is_file():
        train_state = load_weights_only(train_state_file, "training progress")
        with reading(train_state_file, "training progress"):
            return int(train_state["step"])
    return 0


def check_shapes(directory: Path, expected: dict[str, Any], section: str) -> None:
    """Name the tensor and both shapes when a checkpoint does not fit the model."""
    metadata = read_metadata(directory).state_dict_metadata
    for name, value in expected.items():
        if not isinstance(value, torch.Tensor):
            continue
        key = f"{section}.{name}"
        stored = metadata.get(key)
        if stored is None:
            raise CheckpointError(f"checkpoint {directory} has no tensor {name} that the model needs")
        if isinstance(stored, TensorStorageMetadata) and tuple(stored.size) != tuple(value.shape):
            raise CheckpointError(
                f"checkpoint {directory}: tensor {name} has shape {tuple(stored.size)} but the model expects "
                f"{tuple(value.shape)}; the checkpoint was saved for a different model configuration"
            )
