"""Sequence packing of multimodal chat SFT (``dataset.packed_sequence_specs`` with a vision-language model's
processor): several processed conversations, with their images, per training sequence.

The conversations are processed when the dataset is built (``longspan.data.sft.multimodal``), so their token
counts are known: they are put into packs of ``packed_sequence_size`` tokens by the text packing's
first-fit-decreasing (``longspan.data.sft.packing``; each padded to ``pad_seq_to_mult``), in memory (the
images stay in the data directory and are read when a pack is). A pack is one sample of ``P`` tokens::

    documents       a a a a | b b b | (padding)
    position_ids    0 1 2 3   0 1 2   0 1 ...
    cu_seqlens      [0, 4, 7, P]

with the ``[1, P, P]`` mask causal inside each document and blocking everything across documents
(``packing.document_layout``), the per-token processor outputs (``token_type_ids``) laid out with the tokens,
and the per-image outputs (``pixel_values``, ``image_grid_thw``, ``image_position_ids``) concatenated in the
order the documents are in the pack (and packs in microbatch order): the order of the image tokens. The model
numbers its own positions from ``cu_seqlens`` where it has rules of its own (mRoPE: each document from 0, see
``VisionLanguageProvider.image_position_ids``), and keeps its two-way image attention inside each document
(``image_attention_mask``), so each conversation's loss is the one it has alone.

In-batch packing (``enable_in_batch_packing`` of the direct HF SFT data, ``pack_multimodal_rows``) joins the
samples of one microbatch the same way into one ``[1, T]`` sequence (``longspan.data.sft.in_batch_packing``).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np
import torch

from longspan.config.schema.data import PackedSequenceSpecs  # a config class; data re-exports it
from longspan.core.errors import DataError, NotSupportedError
from longspan.core.logging import get_logger, print_rank_0
from longspan.data.sft.in_batch_packing import PACKED_ROW_KEYS, pack_rows
from longspan.data.sft.multimodal import (PER_TOKEN_KEYS, MultimodalChatFormatter, MultimodalDocument,
                                          MultimodalSFTDataset, build_multimodal_docs, concat_image_inputs)
from longspan.data.sft.packing import collate_packs, document_layout, first_fit_decreasing

logger = get_logger(__name__)


def check_multimodal_packing(specs: PackedSequenceSpecs) -> None:
    """The packing options multimodal packs take: packed file paths are refused (the packs are built in memory)."""
    for name in ("packed_train_data_path", "packed_val_data_path"):
        if getattr(specs, name):
            raise NotSupportedError(
                f"dataset.packed_sequence_specs.{name}={getattr(specs, name)!r}: multimodal packs are built in memory "
                "when the dataset is built (their images are read from the data directory); leave it unset")


class MultimodalPackedDataset(torch.utils.data.Dataset):
    """Packs of processed multimodal conversations (see the module docstring).

    Args:
        docs: the processed conversations.
        formatter: the formatter that made them (it processes the images again when a pack is read).
        pack_size: tokens per pack (``packed_sequence_size``).
        pad_id: the padding token id.
        seed: orders equal lengths in first-fit-decreasing.
        pad_to_mult: each document is padded to a multiple of this inside its pack.
        pad_cu_seqlens: ``cu_seqlens`` of every pack padded to the most documents of a pack + 2 values.
        samples: built from the number of packs: sample index -> pack index.
    """

    def __init__(self, docs: list[MultimodalDocument], formatter: MultimodalChatFormatter, pack_size: int,
                 pad_id: int, seed: int, pad_to_mult: int, pad_cu_seqlens: bool,
                 samples: Callable[[int], Any]) -> None:
        self.docs, self.formatter, self.pack_size, self.pad_id = docs, formatter, int(pack_size), pad_id
        self.mult = max(1, int(pad_to_mult or 1))
        lengths = [len(doc.ids) - 1 for doc in docs]
        self.padded = [-(-n // self.mult) * self.mult for n in lengths]
        if max(self.padded) > self.pack_size:
            where = docs[self.padded.index(max(self.padded))].where
            raise DataError(f"{where}: the conversation is {max(self.padded)} tokens (padded to pad_seq_to_mult="
                            f"{self.mult}), more than packed_sequence_size={self.pack_size}")
        self.packs = first_fit_decreasing(self.padded, self.pack_size, seed)
        most = max(len(members) for members in self.packs)
        self.cu_length = most + 2 if pad_cu_seqlens else None
        useful = sum(lengths) / (len(self.packs) * self.pack_size)
        self.meta = {"packed_sequence_size": self.pack_size, "num_packs": len(self.packs),
                     "num_documents": len(docs), "max_samples_per_bin": most,
                     "dataset_max_seqlen": max(lengths), "useful_token_fraction": useful}
        self.samples = samples(len(self.packs))

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        size = self.pack_size
        tokens = torch.full((size,), self.pad_id, dtype=torch.long)
        labels = torch.full((size,), self.pad_id, dtype=torch.long)
        loss_mask = torch.zeros(size, dtype=torch.float32)
        members = self.packs[self.samples[i]]
        doc_of = torch.full((size,), len(members), dtype=torch.long)  # the padding after the last: one more
        per_token: dict[str, torch.Tensor] = {}
        images: dict[str, list[torch.Tensor]] = {}
        offset = 0
        for number, d in enumerate(members):
            doc = self.docs[d]
            n = len(doc.ids) - 1
            tokens[offset: offset + n] = torch.from_numpy(doc.ids[:-1])
            labels[offset: offset + n] = torch.from_numpy(doc.ids[1:])
            loss_mask[offset: offset + n] = torch.from_numpy(doc.in_loss[1:].astype(np.float32))
            doc_of[offset: offset + self.padded[d]] = number
            for key, value in self.formatter.pixel_inputs(doc).items():
                if key in PER_TOKEN_KEYS:
                    per_token.setdefault(key, torch.zeros(size, dtype=value.dtype))[offset: offset + n] = value[:n]
                else:
                    images.setdefault(key, []).append(value)
            offset += self.padded[d]
        position_ids, attention_mask, cu = document_layout(doc_of)
        if self.cu_length is not None and cu.numel() < self.cu_length:
            cu = torch.cat([cu, cu[-1:].expand(self.cu_length - cu.numel())])
        sample = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids,
                  "attention_mask": attention_mask.unsqueeze(0), "cu_seqlens": cu, **per_token,
                  "real_tokens": torch.tensor([len(self.docs[d].ids) - 1 for d in members], dtype=torch.long)}
        sample.update({key: torch.cat(values, dim=0) for key, values in images.items()})
        return sample

    def collate_fn(self, samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Stack the packs (``cu_seqlens`` as ``collate_packs`` does); concatenate the image inputs in order."""
        return collate_multimodal_packs(samples)


def collate_multimodal_packs(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Packs of the same size -> one microbatch: token-aligned keys stacked, a text-only pack's missing per-token
    keys as zeros, image inputs and the documents' ``real_tokens`` (lengths) concatenated in sample order."""
    aligned = {"tokens", "labels", "loss_mask", "position_ids", "attention_mask", "cu_seqlens", *PER_TOKEN_KEYS}
    size = samples[0]["tokens"].numel()
    for key in sorted({k for s in samples for k in s if k in PER_TOKEN_KEYS}):
        for s in samples:
            s.setdefault(key, torch.zeros(size, dtype=torch.long))
    out = collate_packs([{k: v for k, v in s.items() if k in aligned} for s in samples])
    out.update(concat_image_inputs(samples, aligned))
    return out


def build_multimodal_packed_split(path: str, processor: Any, opts: Any, seq_length: int, specs: PackedSequenceSpecs,
                                  samples: Callable[[int], Any], pad_id: int, seed: int,
                                  chat_template: Optional[str] = None, index_workers: int = 1,
                                  cache_dir: Optional[str] = None) -> MultimodalPackedDataset:
    """One JSONL split of chat records with images, every row processed now (cut at
    ``max_single_sequence_length``, default ``seq_length``) and packed into packs of ``seq_length`` tokens."""
    check_multimodal_packing(specs)
    max_len = int(specs.max_single_sequence_length or seq_length)
    docs, formatter = build_multimodal_docs(path, processor, opts, max_len, chat_template, index_workers, cache_dir)
    ds = MultimodalPackedDataset(docs, formatter, seq_length, pad_id, seed, specs.pad_seq_to_mult or 1,
                                 bool(specs.pad_cu_seqlens), samples)
    ds.meta["source"] = path
    print_rank_0(f"packed {ds.meta['num_documents']} multimodal conversations of {path} into {ds.meta['num_packs']} "
                 f"packs of {seq_length} tokens ({ds.meta['useful_token_fraction']:.1%} useful)", logger)
    return ds


def pack_multimodal_rows(samples: list[dict[str, torch.Tensor]], pad_id: int,
                         pad_to_multiple_of: int) -> dict[str, torch.Tensor]:
    """In-batch packing of multimodal samples (``in_batch_packing.pack_rows``'s ``[1, T]`` batch): the per-token
    processor outputs laid out with the tokens (0 in the padding and for samples without them), the image inputs
    concatenated in sample order."""
    out = pack_rows(samples, pad_id, pad_to_multiple_of)
    starts = out["cu_seqlens"][0].tolist()
    total = out["tokens"].shape[1]
    for key in sorted({k for s in samples for k in s if k in PER_TOKEN_KEYS}):
        values = torch.zeros(total, dtype=torch.long)
        for start, s in zip(starts, samples):
            if key in s:
                values[start: start + s[key].numel()] = s[key]
        out[key] = values[None]
    out.update(concat_image_inputs(samples, {*PACKED_ROW_KEYS, "position_ids", *PER_TOKEN_KEYS}))
    return out


class InBatchPackedMultimodalDataset(MultimodalSFTDataset):
    """``MultimodalSFTDataset`` whose microbatches are packed into one sequence (``enable_in_batch_packing`` of the
    direct HF SFT data with ``hf_processor_path``; ``pad_to_multiple_of``: each sample's padding in the pack)."""

    def __init__(self, *args: Any, pad_to_multiple_of: int = 1, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pad_to_multiple_of = int(pad_to_multiple_of)

    def collate_fn(self, samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return pack_multimodal_rows(samples, self.pad_id, self.pad_to_multiple_of)
