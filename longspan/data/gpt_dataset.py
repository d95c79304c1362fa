"""GPT datasets: fixed-length samples cut from shuffled documents, as megatron-core's ``GPTDataset``.

For the same documents, split, seed and sizes the samples, and their order, equal megatron-core's. The
document, sample and shuffle indices are built with numpy (see ``longspan.data.indices``) and cached as
``{md5}-GPTDataset-{split}-{document_index,sample_index,shuffle_index}.npy`` beside a ``description.txt``.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
import warnings
from collections import OrderedDict
from typing import Any, Dict, Optional, Tuple

import numpy as np
import torch

from longspan.config.schema.data import GPTDatasetConfig
from longspan.core.errors import DataError
from longspan.core.logging import get_logger
from longspan.data.indexed_dataset import IndexedDataset
from longspan.data.indices import (
    build_document_index,
    build_sample_index,
    build_shuffle_index,
    num_epochs_for,
)
from longspan.data.utils import Split

logger = get_logger(__name__)

PAD_TOKEN_ID = -1  # a pad id that never occurs in data: used when the tokenizer has no (unique) pad


def resolve_pad_id(tokenizer: Any) -> int:
    """The tokenizer's pad id, or -1 when it has none or it collides with another special token."""
    pad = getattr(tokenizer, "pad", None)
    if pad is None:
        return PAD_TOKEN_ID
    specials = []
    special_dict = getattr(tokenizer, "special_tokens_dict", None)
    if isinstance(special_dict, dict):
        specials = [v for k, v in special_dict.items() if k != "pad_token"]
    if not specials:
        specials = [getattr(tokenizer, "eos", None), getattr(tokenizer, "eod", None)]
    if pad in specials:
        warnings.warn(
            "the tokenizer's pad id equals another special token's id; padding uses -1 instead so that "
            "real tokens are never masked as padding"
        )
        return PAD_TOKEN_ID
    return int(pad)


def tokenizer_identity(tokenizer: Any) -> Dict[str, Any]:
    """What identifies a tokenizer in a cache description (class, vocab size and special ids)."""
    if tokenizer is None:
        return {}
    return {
        "class": type(tokenizer).__name__,
        "vocab_size": getattr(tokenizer, "vocab_size", None),
        "eod": getattr(tokenizer, "eod", None),
        "pad": getattr(tokenizer, "pad", None),
    }


def get_ltor_masks_and_position_ids(
    tokens: torch.Tensor,
    eod_token: Optional[int],
    reset_position_ids: bool,
    reset_attention_mask: bool,
    eod_mask_loss: bool,
    create_attention_mask: bool,
) -> Tuple[Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """(attention_mask [1, s, s] bool with True = masked or None, loss_mask float32 [s], position_ids int64 [s]).

    With resets, a token after an EOD starts a new document: positions restart at 0 and it cannot attend
    to tokens up to and including that EOD.
    """
    s = tokens.numel()
    is_eod = tokens == eod_token if eod_token is not None else torch.zeros(s, dtype=torch.bool)
    loss_mask = torch.ones(s, dtype=torch.float32)
    if eod_mask_loss:
        loss_mask[is_eod] = 0.0
    positions = torch.arange(s, dtype=torch.long)
    # segment[j] = number of EODs before position j: the document a token belongs to.
    eod_before = torch.cumsum(is_eod.long(), 0) - is_eod.long()
    position_ids = positions
    if reset_position_ids:
        starts = torch.where(is_eod, positions + 1, torch.zeros_like(positions))
        # start of the current document = 1 + index of the last EOD strictly before j
        prev_start = torch.cummax(torch.cat([torch.zeros(1, dtype=torch.long), starts[:-1]]), 0).values
        position_ids = positions - prev_start
    attention_mask = None
    if create_attention_mask:
        allowed = torch.tril(torch.ones(s, s, dtype=torch.bool))
        if reset_attention_mask:
            allowed &= eod_before[:, None] == eod_before[None, :]
        attention_mask = (~allowed).unsqueeze(0)
    return attention_mask, loss_mask, position_ids


class GPTDataset(torch.utils.data.Dataset):
    """Samples of ``sequence_length`` (+1 with the extra token) tokens from a split of a low-level dataset.

    Args:
        indexed_dataset: the ``IndexedDataset`` (or mock low-level dataset) to sample from.
        dataset_path: its path prefix, for bookkeeping and the cache description (None for mock data).
        indexed_indices: the sequence indices of this split.
        num_samples: the minimum number of samples to build; None builds one epoch.
        index_split: which split this is (the validation split may keep a padded last sample).
        config: the dataset config (its ``tokenizer`` set).
    """

    def __init__(
        self,
        indexed_dataset: Any,
        dataset_path: Optional[str],
        indexed_indices: np.ndarray,
        num_samples: Optional[int],
        index_split: Split,
        config: GPTDatasetConfig,
    ) -> None:
        self.dataset = indexed_dataset
        self.dataset_path = dataset_path
        self.indices = indexed_indices
        self.num_samples = num_samples
        self.index_split = index_split
        self.config = config
        self.sequence_length = int(config.sequence_length)
        self.add_extra_token = bool(config.add_extra_token_to_sequence)
        self.tokenizer = config.tokenizer
        self.eod = getattr(self.tokenizer, "eod", None)
        self._pad_token_id = resolve_pad_id(self.tokenizer)

        ident: "OrderedDict[str, Any]" = OrderedDict()
        ident["class"] = type(self).__name__
        ident["dataset_path"] = dataset_path
        ident["num_samples"] = num_samples
        ident["index_split"] = index_split.name
        ident["random_seed"] = int(config.random_seed)
        ident["sequence_length"] = self.sequence_length
        ident["split"] = config.split
        ident["add_extra_token_to_sequence"] = self.add_extra_token
        ident["drop_last_partial_validation_sequence"] = bool(config.drop_last_partial_validation_sequence)
        ident["indices"] = [int(indexed_indices[0]), int(indexed_indices[-1]) + 1] if len(indexed_indices) else []
        ident["tokenizer"] = tokenizer_identity(self.tokenizer)
        if dataset_path is not None and os.path.exists(dataset_path + ".idx"):
            ident["idx_bytes"] = os.path.getsize(dataset_path + ".idx")  # a rewritten dataset gets new indices
        self.unique_identifiers = ident
        self.unique_description = json.dumps(ident, indent=4)
        self.unique_description_hash = hashlib.md5(self.unique_description.encode("utf-8")).hexdigest()

        self._cacheable_masks = not any([config.reset_position_ids, config.reset_attention_mask, config.eod_mask_loss])
        self._cached_masks: Optional[tuple] = None
        self.document_index, self.sample_index, self.shuffle_index = self._build_indices()

    # -- low-level dataset hooks (megatron-core's static methods) --------------------------------------
    @staticmethod
    def numel_low_level_dataset(low_level_dataset: Any) -> int:
        """GPT datasets split by sequence."""
        return int(low_level_dataset.sequence_lengths.shape[0])

    @staticmethod
    def build_low_level_dataset(dataset_path: str, config: GPTDatasetConfig) -> IndexedDataset:
        """Open the ``.bin``/``.idx`` pair at ``dataset_path``."""
        return IndexedDataset(dataset_path, multimodal=False, mmap=bool(config.mmap_bin_files))

    # -- index construction -----------------------------------------------------------------------------
    def _cache_dir(self) -> Optional[str]:
        path = self.config.path_to_cache
        if path:
            return str(path)
        if self.dataset_path is None:
            return None
        return os.path.join(os.path.dirname(os.path.abspath(self.dataset_path)), "cache", "GPTDataset_indices")

    def _cache_paths(self, cache_dir: str) -> Dict[str, str]:
        base = f"{self.unique_description_hash}-{type(self).__name__}-{self.index_split.name}"
        names = ("description.txt", "document_index.npy", "sample_index.npy", "shuffle_index.npy")
        return {n.split(".")[0]: os.path.join(cache_dir, f"{base}-{n}") for n in names}

    def _build_indices(self) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        cache_dir = self._cache_dir()
        paths = self._cache_paths(cache_dir) if cache_dir else None
        if paths and all(os.path.isfile(p) for p in paths.values()):
            logger.debug(f"Load the {type(self).__name__} {self.index_split.name} indices from {cache_dir}")
            return tuple(np.load(paths[k], mmap_mode="r") for k in ("document_index", "sample_index", "shuffle_index"))
        t0 = time.time()
        indices = self._compute_indices()
        if paths:
            self._save(paths, indices)
        logger.debug(f"Built the {type(self).__name__} {self.index_split.name} indices in {time.time() - t0:.2f} s")
        return indices

    def _save(self, paths: Dict[str, str], indices: Tuple[np.ndarray, ...]) -> None:
        cache_dir = os.path.dirname(paths["description"])
        try:
            os.makedirs(cache_dir, exist_ok=True)
            # Write each file under a temporary name and rename it, description last, so that a reader
            # never sees a half-written cache.
            for key, arr in zip(("document_index", "sample_index", "shuffle_index"), indices):
                fd, tmp = tempfile.mkstemp(dir=cache_dir, suffix=".npy")
                with os.fdopen(fd, "wb") as f:
                    np.save(f, arr, allow_pickle=False)
                os.replace(tmp, paths[key])
            fd, tmp = tempfile.mkstemp(dir=cache_dir, suffix=".txt")
            with os.fdopen(fd, "w") as f:
                f.write(self.unique_description)
            os.replace(tmp, paths["description"])
        except OSError as exc:
            logger.warning(f"could not cache the dataset indices in {cache_dir} ({exc.strerror}); set "
                           f"dataset.path_to_cache to a writable directory to reuse them")

    def _compute_indices(self) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        seq = self.sequence_length
        extra = 1 if self.add_extra_token else 0
        sizes = np.asarray(self.dataset.sequence_lengths)
        tokens_per_epoch = int(np.sum(sizes[self.indices], dtype=np.int64)) if len(self.indices) else 0
        if tokens_per_epoch < seq + extra:
            if self.num_samples == 0:
                empty = np.zeros(0, dtype=np.int32)
                return empty, np.zeros((1, 2), dtype=np.int32), empty.astype(np.uint32)
            where = self.dataset_path or "mock data"
            raise DataError(
                f"the {self.index_split.name} split of {where} has {len(self.indices)} sequences and "
                f"{tokens_per_epoch} tokens, fewer than one sample of sequence_length {seq}"
                f"{' + 1' if extra else ''}: change dataset.split or add data"
            )
        num_epochs = num_epochs_for(tokens_per_epoch, self.num_samples, seq, extra)
        separate_final_epoch = False
        samples_sans_final = 0
        if num_epochs > 1:
            samples_sans_final = ((num_epochs - 1) * tokens_per_epoch - extra) // seq
            from_final = self.num_samples - samples_sans_final
            per_epoch = (tokens_per_epoch - extra) // seq
            separate_final_epoch = from_final < int(0.80 * per_epoch)
        rng = np.random.RandomState(int(self.config.random_seed))
        document_index = build_document_index(self.indices, num_epochs, rng, separate_final_epoch)
        drop_last = True
        if self.index_split == Split.valid:
            drop_last = bool(self.config.drop_last_partial_validation_sequence)
        sample_index = build_sample_index(
            sizes, document_index, seq, num_epochs, tokens_per_epoch, drop_last, self.add_extra_token
        )
        n = sample_index.shape[0] - 1
        shuffle_index = build_shuffle_index(samples_sans_final if separate_final_epoch else n, n, rng)
        return document_index, sample_index, shuffle_index

    # -- samples ------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return int(self.sample_index.shape[0]) - 1

    def _text(self, idx: int) -> np.ndarray:
        """The ``sequence_length + E`` token ids of sample ``idx`` (padded with the pad id when short)."""
        extra = 1 if self.add_extra_token else 0
        idx = int(self.shuffle_index[idx])
        beg_row, beg_off = (int(x) for x in self.sample_index[idx])
        end_row, end_off = (int(x) for x in self.sample_index[idx + 1])
        parts = []
        if beg_row == end_row:
            parts.append(self.dataset.get(int(self.document_index[beg_row]), offset=beg_off,
                                          length=end_off - beg_off + extra))
        else:
            for row in range(beg_row, end_row + 1):
                offset = beg_off if row == beg_row else 0
                length = end_off + extra if row == end_row else None
                parts.append(self.dataset.get(int(self.document_index[row]), offset=offset, length=length))
        text = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
        want = self.sequence_length + extra
        if len(text) < want:
            text = np.concatenate([text, np.full(want - len(text), self._pad_token_id, dtype=np.int64)])
        return text

    def __getitem__(self, idx: Optional[int]) -> Dict[str, torch.Tensor]:
        """tokens, labels, loss_mask, position_ids (+ attention_mask); ``None`` gives a fully masked pad sample."""
        text = torch.from_numpy(self._text(0 if idx is None else idx))
        if self.add_extra_token:
            tokens, labels = text[:-1].contiguous(), text[1:].contiguous()
        else:
            tokens = text
            labels = torch.roll(text, shifts=-1, dims=0)
            labels[-1] = self._pad_token_id
        cfg = self.config
        create_mask = bool(cfg.create_attention_mask)
        if self._cacheable_masks and self._cached_masks is not None:
            attention_mask, loss_mask, position_ids = self._cached_masks
            loss_mask = loss_mask.clone()
        else:
            attention_mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(
                tokens,
                self.eod,
                bool(cfg.reset_position_ids),
                bool(cfg.reset_attention_mask),
                bool(cfg.eod_mask_loss),
                create_mask,
            )
            if self._cacheable_masks:
                self._cached_masks = (attention_mask, loss_mask.clone(), position_ids)
        pad = self._pad_token_id
        loss_mask[labels == pad] = 0.0
        tokens[tokens == pad] = 0
        labels[labels == pad] = 0
        if idx is None:
            loss_mask = torch.zeros_like(loss_mask)
        sample = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids}
        if create_mask:
            sample["attention_mask"] = attention_mask
        return sample


class MockGPTLowLevelDataset:
    """Synthetic documents: lengths ``default_rng(0).integers(1, 4096, 100000)``; document i is
    ``(arange(L - 1) + 1) % vocab_size`` followed by EOD (megatron-core's mock data)."""

    seed: int = 0
    size: int = 100000
    max_sequence_length: int = 4096

    def __init__(self, tokenizer: Any) -> None:
        self.vocab_size = int(tokenizer.vocab_size)
        self.eod_token = int(tokenizer.eod)
        rng = np.random.default_rng(seed=self.seed)
        self.sequence_lengths = rng.integers(low=1, high=self.max_sequence_length, size=self.size, dtype=np.int32)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> np.ndarray:
        length = int(self.sequence_lengths[idx])
        return np.concatenate(
            [(np.arange(length - 1, dtype=np.int64) + 1) % self.vocab_size, np.array([self.eod_token], np.int64)]
        )

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of document ``idx``."""
        if length is None:
            length = int(self.sequence_lengths[idx]) - offset
        return self[idx][offset : offset + length]


class MockGPTDataset(GPTDataset):
    """GPTDataset over :class:`MockGPTLowLevelDataset` (no files; indices are cached only with path_to_cache)."""

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: MockGPTLowLevelDataset) -> int:
        return len(low_level_dataset)

    @staticmethod
    def build_low_level_dataset(  # type: ignore[override]
        dataset_path: Optional[str], config: GPTDatasetConfig
    ) -> MockGPTLowLevelDataset:
        tokenizer = config.tokenizer
        if tokenizer is None or getattr(tokenizer, "eod", None) is None:
            raise DataError("mock data needs a tokenizer with an EOD token (tokenizer.tokenizer_type=NullTokenizer works)")
        return MockGPTLowLevelDataset(tokenizer)
