"""Reading one ``HFDatasetSourceConfig`` through ``datasets`` into canonical SFT records.

Local data never needs a network: a file is read with the packaged builder of its extension (json for .jsonl and
.json arrays, parquet, csv), a ``save_to_disk`` directory with ``load_from_disk``, another directory with
``load_dataset(directory)``. Anything else is a Hub name: tried only when the Hub answers within a few seconds
(and ``HF_HUB_OFFLINE``/``HF_DATASETS_OFFLINE`` are not set), otherwise one line says so; nothing waits on a
network that is not there.

``datasets`` writes its Arrow cache under ``LONGSPAN_CACHE`` (``~/.cache/longspan``)/hf_datasets unless
``load_kwargs.cache_dir`` says otherwise, never into the data directory; rows are read without ``map`` (which
would write cache files beside a ``save_to_disk`` directory).
"""

from __future__ import annotations

import os
import socket
import threading
from typing import Any, Iterator

from longspan.core.errors import ConfigError, DataError
from longspan.data.sft.schemas import RowError, adapt_row, detect_adapter

INSTALL_HINT = "pip install 'longspan[hf-data]'"
_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
_PACKAGED = ("json", "parquet", "csv", "arrow", "text")
_HUB_HOST = ("huggingface.co", 443)


class MissingSplitError(DataError):
    """The source has no such split (validation and test fall back on this)."""


def _datasets() -> Any:
    try:
        import datasets  # optional dependency (the hf-data extra): only direct HF SFT data needs it
    except ImportError:
        raise ConfigError(f"DirectHFSFTDatasetConfig reads data through the 'datasets' package: {INSTALL_HINT}") from None
    datasets.disable_progress_bars()
    return datasets


def default_cache_dir() -> str:
    """Where ``datasets`` keeps the Arrow files of sources read here."""
    root = os.environ.get("LONGSPAN_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "longspan")
    return os.path.join(root, "hf_datasets")


def describe_source(source: Any) -> str:
    """A short name of a source for messages: its path, or its data_files."""
    files = (source.load_kwargs or {}).get("data_files")
    if files is not None and source.path_or_dataset in _PACKAGED:
        return str(files) if not isinstance(files, (list, tuple)) or len(files) != 1 else str(files[0])
    return str(source.path_or_dataset)


def hub_reachable(timeout: float = 3.0) -> bool:
    """True when the Hub answers within ``timeout`` seconds and offline mode is not set (a name lookup can
    block without its own timeout, so the check runs in a thread that is abandoned if it is late)."""
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false") or os.environ.get(
            "HF_DATASETS_OFFLINE", "0") not in ("0", "", "false"):
        return False
    result: list[bool] = []

    def probe() -> None:
        try:
            with socket.create_connection(_HUB_HOST, timeout=timeout):
                result.append(True)
        except OSError:
            result.append(False)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout + 0.5)
    return bool(result and result[0])


def _is_saved_dataset(path: str) -> bool:
    names = set(os.listdir(path))
    return "dataset_dict.json" in names or ("state.json" in names and "dataset_info.json" in names)


def _load(source: Any, split: str) -> Any:
    """The ``datasets.Dataset`` of one split of ``source`` (DataError/ConfigError in one line)."""
    ds = _datasets()
    path = os.path.expanduser(str(source.path_or_dataset))
    kwargs = dict(source.load_kwargs or {})
    kwargs.setdefault("cache_dir", default_cache_dir())
    subsets = source.subset if isinstance(source.subset, list) else [source.subset]
    where = describe_source(source)
    if source.subset is not None and (os.path.isfile(path) or path in _PACKAGED or (
            os.path.isdir(path) and _is_saved_dataset(path))):
        raise ConfigError(f"{where}: subset={source.subset!r} names a configuration, but a single file or a "
                          "save_to_disk directory has none: leave subset unset (or use a dataset directory whose "
                          "README.md declares configs)")
    if os.path.isdir(path) and _is_saved_dataset(path):
        loaded = ds.load_from_disk(path)
        if isinstance(loaded, ds.DatasetDict):
            if split not in loaded:
                raise MissingSplitError(f"{where} has no split {split!r} (splits: {', '.join(loaded)})")
            return loaded[split]
        if split != "train":
            raise MissingSplitError(f"{where} is one saved dataset, without a {split!r} split")
        return loaded
    if os.path.isfile(path):
        builder = _BUILDERS.get(os.path.splitext(path)[1].lower())
        if builder is None:
            raise DataError(f"{where}: unknown file type; use .jsonl, .json, .parquet, .csv or a save_to_disk directory")
        _check_local_file(path, builder, where, split)
        kwargs.setdefault("data_files", path)
        path = builder
    elif not os.path.isdir(path) and path not in _PACKAGED:
        looks_local = path.startswith((".", "/", "~")) or path.count("/") > 1 or os.path.splitext(path)[1] in _BUILDERS
        if looks_local:
            raise DataError(f"{where} does not exist")
        if not hub_reachable():
            raise DataError(f"{where} is not a local file or directory and the Hugging Face Hub cannot be reached "
                            "(no network or offline mode): download the data and give its path")
    parts = []
    for subset in subsets:
        try:
            parts.append(ds.load_dataset(path, subset, split=split, **kwargs))
        except (ValueError, KeyError) as exc:
            if "split" in str(exc).lower() or isinstance(exc, KeyError):
                raise MissingSplitError(f"{where} has no split {split!r} ({_first_line(exc)})") from None
            raise DataError(f"{where}: cannot be read: {_first_line(exc)}") from None
        except Exception as exc:  # noqa: BLE001 - datasets/pyarrow raise many kinds for a damaged file
            raise DataError(f"{where}: cannot be read ({type(exc).__name__}): {_first_line(exc)}") from None
    return parts[0] if len(parts) == 1 else ds.concatenate_datasets(parts)


def _check_local_file(path: str, builder: str, where: str, split: str) -> None:
    """Files ``datasets`` cannot turn into an empty split (it fails on them with a generic generation error):
    no rows, or a Parquet file whose footer is damaged."""
    if builder == "parquet":
        # pyarrow comes with datasets (the hf-data extra)
        import pyarrow.parquet as pq

        try:
            rows = pq.ParquetFile(path).metadata.num_rows
        except Exception as exc:  # noqa: BLE001 - pyarrow's errors for a damaged file vary by version
            raise DataError(f"{where}: cannot be read as Parquet (truncated or damaged?): {_first_line(exc)}") from None
    else:
        with open(path, "rb") as f:
            head = f.read(4096).strip()
        rows = 0 if head in (b"", b"[]") else 1
    if rows == 0:
        raise DataError(f"{where} split {split!r} has no rows")


def _first_line(exc: BaseException) -> str:
    while exc.__cause__ is not None and str(exc.__cause__).strip():
        exc = exc.__cause__  # datasets wraps the reader's own error in a generic one
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


def _rows(dataset: Any, where: str) -> Iterator[dict[str, Any]]:
    try:
        yield from dataset
    except Exception as exc:  # noqa: BLE001 - a file damaged past its header fails only when read
        raise DataError(f"{where}: cannot be read ({type(exc).__name__}): {_first_line(exc)}") from None


def load_source_records(source: Any, split: str) -> list[dict[str, Any]]:
    """Every row of ``split`` of ``source`` as a canonical record (``{"messages"}`` or ``{"text"}``).

    A row no adapter can read stops here with file, row and reason; an empty split too.
    """
    where = describe_source(source)
    dataset = _load(source, split)
    if len(dataset) == 0:
        raise DataError(f"{where} split {split!r} has no rows")
    adapter = source.schema_adapter or detect_adapter(list(dataset.column_names), source.adapter_kwargs, where)
    records = []
    for index, row in enumerate(_rows(dataset, where)):
        try:
            records.append(adapt_row(adapter, row, source.adapter_kwargs))
        except RowError as exc:
            raise DataError(f"{where} row {index}: {exc} (schema_adapter {adapter!r})") from None
    return records
