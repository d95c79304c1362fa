"""SFT datasets over ``dataset_root/{training,validation,test}.jsonl`` (Megatron Bridge's FinetuningDatasetConfig).

Sample order: the training split is ``num_samples`` long (``dataset.max_train_samples``, else what the run needs:
``train_iters x global_batch_size``) and walks the records epoch after epoch, each epoch in the permutation
drawn from ``(dataset.seed, epoch)``. Sample ``i`` is a pure function of ``i``, so Megatron's samplers resume
exactly from ``consumed_train_samples``. Validation and test read their records in file order (repeating
when the run evaluates more samples than there are records).

Batches (``collate_fn``): ``tokens``, ``labels``, ``position_ids`` int64 and ``loss_mask`` float32 ``[b, s]``;
padded positions have ``loss_mask`` 0, so loss sums and token counts cover loss tokens only. ``s`` is the
longest sample of the microbatch rounded up to ``pad_seq_length_to_mult``, or ``seq_length`` with
``dataset_kwargs.pad_to_max_length`` (the default under pipeline parallel, whose stages exchange fixed shapes).
``real_tokens`` ``[b]`` holds each row's tokens before the padding (what throughput counts). Unpacked batches carry no
attention mask: right padding under the model's causal mask cannot affect the real tokens. Packed batches
(``PackedSFTDataset``) carry a block-diagonal ``attention_mask`` (see ``longspan.data.sft.packing``).
"""

from __future__ import annotations

import json
import os
from functools import partial
from typing import Any, Optional

import numpy as np
import torch

from longspan.config.schema.data import FinetuningDatasetConfig
from longspan.core.errors import ConfigError, DataError
from longspan.core.logging import get_logger, print_rank_0
from longspan.data.sft.formatting import RecordFormatter, SFTFormatOptions, parse_format_options, resolve_padding
from longspan.data.sft.jsonl_index import JsonlIndex, cache_directory_for, file_fingerprint
from longspan.data.sft.multimodal import build_multimodal_jsonl_split
from longspan.data.sft.multimodal_packing import build_multimodal_packed_split
from longspan.data.sft.packing import (
    PackedSequenceSpecs,
    collate_packs,
    pack_jsonl,
    pack_to_sample,
    packing_fingerprint,
    read_meta,
    resolve_packed_specs,
)

logger = get_logger(__name__)

SPLIT_FILES = {"train": "training.jsonl", "validation": "validation.jsonl", "test": "test.jsonl"}


class EpochSampleMap:
    """Sample index -> item index: consecutive epochs over ``num_items``, each a seeded permutation (or in order)."""

    def __init__(self, num_items: int, num_samples: int, seed: int, shuffle: bool) -> None:
        if num_items <= 0:
            raise DataError("the dataset has no records")
        self.num_items, self.num_samples, self.seed, self.shuffle = num_items, num_samples, seed, shuffle

    def __len__(self) -> int:
        return self.num_samples

    def _order(self, epoch: int) -> np.ndarray:
        cached = getattr(self, "_cached", None)
        if cached is None or cached[0] != epoch:
            cached = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.num_items))
            self._cached = cached
        return cached[1]

    def __getitem__(self, i: int) -> int:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} of {self.num_samples}")
        epoch, pos = divmod(int(i), self.num_items)
        return int(self._order(epoch)[pos]) if self.shuffle else pos


class _Location:
    """'FILE line N' of a record, computed only when an error message needs it."""

    def __init__(self, index: JsonlIndex, item: int) -> None:
        self.index, self.item = index, item

    def __str__(self) -> str:
        return f"{self.index.path} line {self.index.line_number(self.item)}"


def pad_token_id(tokenizer: Any) -> int:
    """The id used for padding: the tokenizer's pad, else EOS/EOD, else 0 (padding never carries loss)."""
    for name in ("pad", "eos", "eod"):
        value = getattr(tokenizer, name, None)
        if value is not None:
            return int(value)
    return 0


class SFTDataset(torch.utils.data.Dataset):
    """One JSONL split, formatted and tokenized on access (in DataLoader workers when there are any).

    Args:
        path: the .jsonl file.
        tokenizer: a longspan tokenizer.
        seq_length: tokens per sample (records are truncated to ``seq_length + 1`` ids).
        num_samples: length of the dataset (epochs over the records); None: one pass.
        seed: the shuffle seed; ``shuffle=False`` keeps file order.
        opts: formatting options (``dataset.dataset_kwargs``).
        chat_template: overrides the tokenizer's chat template.
        index_workers: threads that build the line index (``dataset.memmap_workers``).
        cache_dir: where the line index is cached (default: beside the file when writable, see
            ``cache_directory_for``).

    Every record is parsed and its keys checked against the formatting options here, once (the index keeps
    the key sets), so a bad line stops the run before its first step.
    """

    def __init__(self, path: str, tokenizer: Any, seq_length: int, num_samples: Optional[int], seed: int,
                 shuffle: bool, opts: SFTFormatOptions, chat_template: Optional[str] = None,
                 index_workers: int = 1, cache_dir: Optional[str] = None) -> None:
        self.path = path
        self.index = JsonlIndex(path, workers=index_workers, cache_dir=cache_dir)
        if len(self.index) == 0:
            raise DataError(f"{path} has no records")
        self.seq_length = seq_length
        self.opts = opts
        self.format_record = RecordFormatter(tokenizer, opts, seq_length + 1, chat_template)
        for keys, first in self.index.key_sets:
            self.format_record.check_keys(keys, self.location(first))
        self.samples = EpochSampleMap(len(self.index), num_samples or len(self.index), seed, shuffle)
        self.pad_id = pad_token_id(tokenizer)

    def __len__(self) -> int:
        return len(self.samples)

    def location(self, item: int) -> _Location:
        return _Location(self.index, item)

    def document(self, item: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids, in_loss) of record ``item``."""
        ids, in_loss = self.format_record(self.index.record(item), self.location(item))
        if len(ids) < 2:
            raise DataError(f"{self.location(item)}: the record gives {len(ids)} token(s); a sample needs at least 2")
        return ids, in_loss

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids, in_loss = self.document(self.samples[i])
        ids_t = torch.from_numpy(ids)
        return {
            "tokens": ids_t[:-1],
            "labels": ids_t[1:],
            "loss_mask": torch.from_numpy(in_loss[1:].astype(np.float32)),
            "position_ids": torch.arange(len(ids) - 1),
        }

    def real_lengths(self, count: int = 64) -> list[int]:
        """The real (unpadded) token counts of the first ``count`` samples, for the start-up line."""
        return [self[i]["tokens"].numel() for i in range(min(count, len(self)))]

    def padding_text(self) -> str:
        """How microbatches are padded: to seq_length, or to their longest sample (a multiple of ...)."""
        if self.opts.pad_to_max_length:
            return f"padded to seq_length={self.seq_length}"
        return f"padded to their longest sample (a multiple of {self.opts.pad_seq_length_to_mult})"

    def padded_length(self, longest: int) -> int:
        if self.opts.pad_to_max_length:
            return self.seq_length
        mult = self.opts.pad_seq_length_to_mult
        return min(-(-longest // mult) * mult, max(self.seq_length, longest))

    def collate_fn(self, samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Right-pad the samples of a microbatch (padding: pad id, loss_mask 0, positions continuing)."""
        length = self.padded_length(max(s["tokens"].numel() for s in samples))
        b = len(samples)
        out = {
            "tokens": torch.full((b, length), self.pad_id, dtype=torch.long),
            "labels": torch.full((b, length), self.pad_id, dtype=torch.long),
            "loss_mask": torch.zeros((b, length), dtype=torch.float32),
            "position_ids": torch.arange(length).repeat(b, 1),
            "real_tokens": torch.tensor([s["tokens"].numel() for s in samples], dtype=torch.long),
        }
        for row, s in enumerate(samples):
            n = s["tokens"].numel()
            for key in ("tokens", "labels", "loss_mask"):
                out[key][row, :n] = s[key]
        return out


class PackedSFTDataset(torch.utils.data.Dataset):
    """Packs of a packed ``.npy`` file (see ``longspan.data.sft.packing``), epochs in seeded orders."""

    def __init__(self, packed_path: str, num_samples: Optional[int], seed: int, shuffle: bool,
                 pad_cu_seqlens: bool = False) -> None:
        self.path = packed_path
        try:
            self.packs = np.load(packed_path, mmap_mode="r")
        except (OSError, ValueError) as exc:
            raise DataError(f"cannot read packed data {packed_path}: {exc}") from None
        if self.packs.ndim != 3 or self.packs.shape[1] != 3 or self.packs.shape[0] == 0:
            raise DataError(f"{packed_path} is not a longspan packed file ([num_packs, 3, size], got {self.packs.shape})")
        meta = read_meta(packed_path) or {}
        self.cu_length = int(meta["max_samples_per_bin"]) + 2 if pad_cu_seqlens and "max_samples_per_bin" in meta else None
        if pad_cu_seqlens and self.cu_length is None:
            raise DataError(f"packed_sequence_specs.pad_cu_seqlens=True needs {packed_path}.meta.json (max_samples_per_bin)")
        self.samples = EpochSampleMap(self.packs.shape[0], num_samples or self.packs.shape[0], seed, shuffle)

    @property
    def pack_size(self) -> int:
        return int(self.packs.shape[2])

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return pack_to_sample(np.asarray(self.packs[self.samples[i]]), self.cu_length)

    def collate_fn(self, samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return collate_packs(samples)


# ------------------------------------------------------------------------------------------- building

def _packed_path(root: str, split: str, specs: PackedSequenceSpecs, tokenizer: Any,
                 cache_dir: Optional[str] = None) -> str:
    """The given packed path, else ``{cache}/packed/{tokenizer}/{split}_{size}.npy`` with the cache directory
    of ``root`` (``root`` itself when writable)."""
    given = specs.packed_train_data_path if split == "train" else specs.packed_val_data_path if split == "validation" else None
    if given:
        return str(given)
    name = specs.tokenizer_model_name or type(tokenizer).__name__
    name = str(name).replace("/", "--")
    stem = os.path.splitext(SPLIT_FILES[split])[0]
    return os.path.join(cache_dir or root, "packed", name, f"{stem}_{specs.packed_sequence_size}.npy")


def _settings(tokenizer: Any, opts: SFTFormatOptions, seq_len: int, specs: PackedSequenceSpecs, seed: int,
              chat_template: Optional[str]) -> dict[str, Any]:
    tok_id = {"class": type(tokenizer).__name__, "vocab_size": getattr(tokenizer, "vocab_size", None),
              "path": os.path.abspath(str(getattr(tokenizer, "path", ""))), "eos": getattr(tokenizer, "eos", None),
              "bos": getattr(tokenizer, "bos", None)}
    # the microbatch padding options shape no pack: packs made before the layout decided them stay valid
    options = {k: v for k, v in vars(opts).items() if k not in ("pad_to_max_length", "pad_seq_length_to_mult")}
    return {"tokenizer": tok_id, "options": options, "max_len": seq_len, "pack": specs.packed_sequence_size,
            "pad_seq_to_mult": specs.pad_seq_to_mult or 1, "seed": seed, "chat_template": chat_template}


def prepare_packed_split(jsonl_path: str, out_path: str, tokenizer: Any, opts: SFTFormatOptions, seq_length: int,
                         specs: PackedSequenceSpecs, seed: int, chat_template: Optional[str] = None,
                         index_workers: int = 1, rebuild_stale: bool = True,
                         cache_dir: Optional[str] = None) -> dict[str, Any]:
    """Make sure ``out_path`` holds the packs of ``jsonl_path``; returns its metadata.

    An existing file whose fingerprint (source file, tokenizer, options) matches is reused; a stale one is
    rebuilt when ``rebuild_stale`` (the default cache), else used as given (an explicit packed path).
    """
    max_len = specs.max_single_sequence_length or seq_length
    meta = read_meta(out_path)
    exists = os.path.isfile(out_path)
    if exists and not os.path.isfile(jsonl_path) and not rebuild_stale:
        return meta or {}
    if not os.path.isfile(jsonl_path):
        raise DataError(f"data file {jsonl_path} does not exist")
    settings = _settings(tokenizer, opts, max_len, specs, seed, chat_template)
    fingerprint = packing_fingerprint(file_fingerprint(jsonl_path), settings)
    if exists and meta is not None and (meta.get("fingerprint") == fingerprint or not rebuild_stale):
        return meta
    formatter = SFTDataset(jsonl_path, tokenizer, max_len, None, seed, False, opts, chat_template, index_workers,
                           cache_dir)
    return pack_jsonl(formatter.index, formatter.format_record, out_path, specs, seed, formatter.pad_id, fingerprint,
                      formatter.location)


def pack_sft_dataset(root: str, tokenizer: Any, specs: PackedSequenceSpecs, seq_length: Optional[int] = None,
                     seed: int = 1234, dataset_kwargs: Optional[dict[str, Any]] = None,
                     chat_template: Optional[str] = None, index_workers: int = 1,
                     path_to_cache: Optional[str] = None) -> list[tuple[str, dict[str, Any]]]:
    """Pack training.jsonl and validation.jsonl of ``root`` ahead of time (``longspan preprocess --pack-sft``).

    The files go where training looks for them (``specs``' packed paths, else ``root/packed/...``), with the
    fingerprint training checks, so a run with the same tokenizer, seed and options reuses them.
    Returns ``[(packed path, metadata)]`` per packed split.
    """
    opts = parse_format_options(dataset_kwargs)
    seq_length = seq_length or specs.packed_sequence_size
    cache_dir = cache_directory_for(root, path_to_cache)
    out = []
    for split in ("train", "validation"):
        path = os.path.join(root, SPLIT_FILES[split])
        if not os.path.isfile(path):
            if split == "train":
                raise DataError(f"data file {path} does not exist")
            continue
        packed = _packed_path(root, split, specs, tokenizer, cache_dir)
        out.append((packed, prepare_packed_split(path, packed, tokenizer, opts, seq_length, specs, seed, chat_template,
                                                 index_workers, cache_dir=cache_dir)))
    return out


def _missing_hint(split: str) -> str:
    return "" if split == "train" else f" (or set dataset.do_{split}=False)"


def _is_chat_file(path: str, opts: SFTFormatOptions, workers: int, cache_dir: str) -> bool:
    """Whether the records of ``path`` are chat records (``dataset_kwargs.chat``, else every record's keys)."""
    if opts.chat is not None:
        return opts.chat
    return all(opts.messages_key in keys for keys, _ in JsonlIndex(path, workers=workers, cache_dir=cache_dir).key_sets)


def _split_samples(split: str, num_items: int, needed: int, seed: int) -> EpochSampleMap:
    """Training: ``needed`` samples over seeded epochs; evaluation: file order, at least one pass."""
    if split == "train":
        return EpochSampleMap(num_items, needed, seed, shuffle=True)
    return EpochSampleMap(num_items, max(needed, num_items), seed, shuffle=False)


def _packed_split(root: str, split: str, path: str, needed: int, tokenizer: Any, opts: SFTFormatOptions,
                  seq_length: int, specs: PackedSequenceSpecs, seed: int, chat_template: Optional[str],
                  workers: int, metas: list[dict[str, Any]], cache_dir: str) -> PackedSFTDataset:
    """The packed dataset of one split; the packs are built (or rebuilt when stale) unless given explicitly."""
    packed = _packed_path(root, split, specs, tokenizer, cache_dir)
    explicit = bool(specs.packed_train_data_path if split == "train" else specs.packed_val_data_path)
    if not os.path.isfile(path) and not (explicit and os.path.isfile(packed)):
        raise DataError(f"data file {path} does not exist{_missing_hint(split)}")
    metas.append(prepare_packed_split(path, packed, tokenizer, opts, seq_length, specs, seed, chat_template, workers,
                                      rebuild_stale=not explicit, cache_dir=cache_dir))
    ds = PackedSFTDataset(packed, None, seed, split == "train", bool(specs.pad_cu_seqlens))
    if ds.pack_size != seq_length:
        raise DataError(f"{packed} holds packs of {ds.pack_size} tokens, not packed_sequence_size={seq_length}")
    ds.samples = _split_samples(split, ds.packs.shape[0], needed, seed)
    return ds


def _multimodal_packed_split(path: str, processor: Any, opts: SFTFormatOptions, seq_length: int,
                             specs: PackedSequenceSpecs, split: str, needed: int, seed: int, pad_id: int,
                             chat_template: Optional[str], workers: int, cache_dir: str) -> torch.utils.data.Dataset:
    """The packs of one split of multimodal chat records, built in memory (``longspan.data.sft.multimodal_packing``)."""
    return build_multimodal_packed_split(path, processor, opts, seq_length, specs,
                                         partial(_split_samples, split, needed=needed, seed=seed), pad_id, seed,
                                         chat_template, workers, cache_dir)


def build_sft_datasets(dataset_cfg: FinetuningDatasetConfig, tokenizer: Any, sizes: tuple[int, int, int],
                       seq_length: int, chat_template: Optional[str] = None,
                       processor: Optional[Any] = None,
                       opts: Optional[SFTFormatOptions] = None) -> list[Optional[torch.utils.data.Dataset]]:
    """[train, validation, test] datasets of a FinetuningDatasetConfig (None for a split not built).

    ``sizes`` are the samples the run needs per split (Megatron's train/valid/test numbers). With the HF
    ``processor`` of a vision-language model, chat records (with or without images) are processed by it
    (``longspan.data.sft.multimodal``); prompt/completion records keep the text path. ``opts``: the formatting
    options with the padding decided for the layout (``longspan.data.loaders.sft_padding``); None: the dataset's
    ``dataset_kwargs`` on one device (padding unset: to the longest sample).
    """
    root = dataset_cfg.dataset_root
    if root is None:
        raise ConfigError("dataset.dataset_root is not set: give the directory with training.jsonl and validation.jsonl")
    root = str(root)
    if not os.path.isdir(root):
        raise DataError(f"dataset.dataset_root={root} is not a directory")
    if opts is None:
        opts = resolve_padding(parse_format_options(dataset_cfg.dataset_kwargs), dataset_cfg.dataset_kwargs,
                               fixed_shapes=False, multiple=1)
    specs = resolve_packed_specs(dataset_cfg.packed_sequence_specs)
    seed = int(dataset_cfg.seed)
    workers = int(dataset_cfg.memmap_workers or 1)
    # Not a FinetuningDatasetConfig field: Megatron's name for the cache directory, honoured when a caller sets it
    path_to_cache = getattr(dataset_cfg, "path_to_cache", None)  # getattr: an attribute set on the object, not a field
    cache_dir = cache_directory_for(root, path_to_cache)
    if cache_dir != os.path.abspath(root):
        print_rank_0(f"{root} is not writable: its line indexes and packs are cached in {cache_dir}", logger)
    train_needed, valid_needed, test_needed = sizes
    max_train = dataset_cfg.max_train_samples
    if max_train is not None:
        if max_train < train_needed:
            raise ConfigError(
                f"dataset.max_train_samples={max_train} is fewer than the {train_needed} samples the run trains on "
                f"(train_iters x global_batch_size); raise it or leave it None"
            )
        train_needed = int(max_train)
    if specs is not None and specs.packed_sequence_size != seq_length:
        raise ConfigError(
            f"dataset.packed_sequence_specs.packed_sequence_size={specs.packed_sequence_size} differs from "
            f"model.seq_length={seq_length}: a pack is one training sequence, set them equal"
        )
    wanted = {"train": True, "validation": bool(dataset_cfg.do_validation), "test": bool(dataset_cfg.do_test)}
    needed = {"train": train_needed, "validation": valid_needed, "test": test_needed}
    out: list[Optional[torch.utils.data.Dataset]] = []
    metas: list[dict[str, Any]] = []
    for split in ("train", "validation", "test"):
        path = os.path.join(root, SPLIT_FILES[split])
        if not wanted[split] or needed[split] <= 0:
            out.append(None)
        elif split == "test" and not os.path.isfile(path):
            print_rank_0(f"no {path}: the test split is skipped", logger)
            out.append(None)
        elif processor is not None and os.path.isfile(path) and _is_chat_file(path, opts, workers, cache_dir):
            if specs is not None and split != "test":
                out.append(_multimodal_packed_split(path, processor, opts, seq_length, specs, split, needed[split],
                                                    seed, pad_token_id(tokenizer), chat_template, workers, cache_dir))
                metas.append(out[-1].meta)
                continue
            out.append(build_multimodal_jsonl_split(
                path, processor, opts, seq_length, partial(_split_samples, split, needed=needed[split], seed=seed),
                pad_token_id(tokenizer), chat_template, workers, cache_dir))
        elif specs is None or split == "test":
            if not os.path.isfile(path):
                raise DataError(f"data file {path} does not exist{_missing_hint(split)}")
            ds = SFTDataset(path, tokenizer, seq_length, None, seed, split == "train", opts, chat_template, workers,
                            cache_dir)
            ds.samples = _split_samples(split, len(ds.index), needed[split], seed)
            out.append(ds)
        else:
            out.append(_packed_split(root, split, path, needed[split], tokenizer, opts, seq_length, specs, seed,
                                     chat_template, workers, metas, cache_dir))
    if specs is not None and specs.packed_metadata_path and metas:
        with open(specs.packed_metadata_path, "w") as f:
            json.dump(metas, f, indent=1)
    return out
