"""Sequence packing for SFT: several documents per training sequence, without attention between them.

Offline step (``pack_jsonl``): every record is formatted and tokenized, each document becomes its sample
(``tokens = ids[:-1]``, ``labels = ids[1:]``, loss flags), and the documents are put into packs of
``packed_sequence_size`` tokens by first-fit-decreasing (longest first; equal lengths in a seeded random
order; each document into the first pack with room). The packs are written to one ``.npy`` file, int32
``[num_packs, 3, packed_sequence_size]``: row 0 the input tokens, row 1 the labels (-1 where no loss), row 2 the
document number inside the pack (the padding at the end of a pack is one more "document"), plus a
``.meta.json`` beside it (sizes, ``max_samples_per_bin``, ``dataset_max_seqlen``, and the fingerprint of the
source, tokenizer and options, so a stale cache is rebuilt).

Training (``PackedSFTDataset``): a pack is one sample; per-document ``position_ids`` restart at 0, and the
``attention_mask`` ``[1, P, P]`` (bool, True = masked, Megatron's convention) is causal inside each document and
blocks everything across documents, so the loss of a pack is exactly the sum of its documents' losses computed
one by one. The model takes the dense mask in every layout: tensor parallel does not touch it, every pipeline
stage's forward step reads it from the microbatch, and context parallel slices its query rows.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import fields
from typing import Any, Callable, Iterable, Optional

import numpy as np
import torch

from longspan.config.schema.data import PackedSequenceSpecs  # a config class; data re-exports it
from longspan.core.errors import ConfigError, DataError, NotSupportedError
from longspan.core.logging import get_logger, print_rank_0

logger = get_logger(__name__)

PACK_FORMAT_VERSION = 1


def resolve_packed_specs(value: Any) -> Optional[PackedSequenceSpecs]:
    """``dataset.packed_sequence_specs`` (None, a mapping or a specs object) -> specs, or None when packing is off."""
    if value is None:
        return None
    known = {f.name for f in fields(PackedSequenceSpecs)}
    if isinstance(value, dict):
        data = {k: v for k, v in value.items() if k != "_target_"}
    else:
        data = {k: getattr(value, k) for k in known if hasattr(value, k)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise NotSupportedError(f"dataset.packed_sequence_specs has unknown field(s) {unknown}; valid: {sorted(known)}")
    specs = PackedSequenceSpecs(**data)
    if not isinstance(specs.packed_sequence_size, int):
        raise ConfigError(
            f"dataset.packed_sequence_specs.packed_sequence_size={specs.packed_sequence_size!r} must be an integer"
        )
    if specs.packed_sequence_size <= 0:
        return None
    if specs.num_tokenizer_workers not in (-1, None):
        raise NotSupportedError(
            f"dataset.packed_sequence_specs.num_tokenizer_workers={specs.num_tokenizer_workers}: only -1 is supported "
            "(use `longspan preprocess --pack-sft` ahead of time for large sets)"
        )
    mult = specs.pad_seq_to_mult or 1
    if not isinstance(mult, int) or mult < 1:
        raise ConfigError(f"dataset.packed_sequence_specs.pad_seq_to_mult={specs.pad_seq_to_mult!r} must be >= 1")
    if specs.max_single_sequence_length is not None and not 1 <= specs.max_single_sequence_length <= specs.packed_sequence_size:
        raise ConfigError(
            f"dataset.packed_sequence_specs.max_single_sequence_length={specs.max_single_sequence_length} must be "
            f"between 1 and packed_sequence_size={specs.packed_sequence_size}"
        )
    return specs


# --------------------------------------------------------------------------------- first-fit-decreasing

def first_fit_decreasing(lengths: Iterable[int], capacity: int, seed: int) -> list[list[int]]:
    """Bins (lists of item indices) of at most ``capacity`` in total length, by first-fit-decreasing.

    Items are taken longest first, equal lengths in an order drawn from ``seed``; each goes into the first
    (lowest-numbered) bin with room, found in O(log bins) with a max-tree over the bins' free space.
    """
    lengths = np.asarray(list(lengths), dtype=np.int64)
    if lengths.size == 0:
        return []
    if lengths.max() > capacity or lengths.min() < 1:
        raise DataError(f"cannot pack items of lengths {lengths.min()}..{lengths.max()} into bins of {capacity}")
    tie_break = np.random.default_rng(seed).permutation(lengths.size)
    order = np.lexsort((tie_break, -lengths))
    size = 1
    while size < lengths.size:
        size *= 2
    free = np.full(2 * size, capacity, dtype=np.int64)  # leaves: free space of bin i (unused bins are empty)
    bins: list[list[int]] = []
    for item in order.tolist():
        need = int(lengths[item])
        node = 1
        while node < size:  # descend to the leftmost leaf with enough room
            node = 2 * node if free[2 * node] >= need else 2 * node + 1
        b = node - size
        if b == len(bins):
            bins.append([])
        bins[b].append(item)
        free[node] -= need
        node //= 2
        while node:
            free[node] = max(free[2 * node], free[2 * node + 1])
            node //= 2
    return bins


# ------------------------------------------------------------------------------------------ packing

def document_sample(ids: np.ndarray, in_loss: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, labels with -1 where no loss) of one formatted document."""
    labels = ids[1:].astype(np.int64).copy()
    labels[in_loss[1:] == 0] = -1
    return ids[:-1], labels


def pack_documents(
    documents: list[tuple[np.ndarray, np.ndarray]], pack_size: int, seed: int, pad_id: int, pad_to_mult: int = 1
) -> tuple[np.ndarray, dict[str, Any]]:
    """Pack ``(tokens, labels)`` documents: the int32 ``[num_packs, 3, pack_size]`` array and its metadata."""
    mult = max(1, int(pad_to_mult or 1))
    lengths = [len(t) for t, _ in documents]
    padded = [-(-n // mult) * mult for n in lengths]
    if any(p > pack_size for p in padded):
        raise DataError(f"a document of {max(padded)} tokens does not fit packed_sequence_size={pack_size}")
    bins = first_fit_decreasing(padded, pack_size, seed)
    out = np.empty((len(bins), 3, pack_size), dtype=np.int32)
    useful = 0
    for p, members in enumerate(bins):
        out[p, 0], out[p, 1], out[p, 2] = pad_id, -1, len(members)
        pos = 0
        for number, d in enumerate(members):
            tokens, labels = documents[d]
            n = len(tokens)
            out[p, 0, pos:pos + n] = tokens
            out[p, 1, pos:pos + n] = labels
            out[p, 2, pos:pos + padded[d]] = number
            pos += padded[d]
            useful += n
    meta = {
        "packed_sequence_size": pack_size,
        "num_packs": len(bins),
        "num_documents": len(documents),
        "max_samples_per_bin": max((len(b) for b in bins), default=0),
        "dataset_max_seqlen": max(lengths, default=0),
        "useful_token_fraction": useful / max(1, len(bins) * pack_size),
    }
    return out, meta


def write_packed(path: str, packs: np.ndarray, meta: dict[str, Any]) -> None:
    """Write the packs (.npy) and ``{path}.meta.json`` atomically."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        np.save(f, packs)
    os.replace(tmp, path)
    with open(tmp, "w") as f:
        json.dump(meta, f, indent=1)
    os.replace(tmp, meta_path(path))


def meta_path(packed_path: str) -> str:
    """The metadata file beside a packed .npy file."""
    return packed_path + ".meta.json"


def read_meta(packed_path: str) -> Optional[dict[str, Any]]:
    """The metadata of a packed file, or None when absent or unreadable."""
    try:
        with open(meta_path(packed_path)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def packing_fingerprint(source_fingerprint: dict[str, Any], settings: dict[str, Any]) -> str:
    """A hash of what a packed file depends on (the source file, tokenizer and formatting settings)."""
    blob = json.dumps({"v": PACK_FORMAT_VERSION, "source": source_fingerprint, "settings": settings}, sort_keys=True,
                      default=str)
    return hashlib.sha1(blob.encode()).hexdigest()


def pack_jsonl(
    index: Any,
    format_record: Callable[[dict[str, Any], Any], tuple[np.ndarray, np.ndarray]],
    out_path: str,
    specs: PackedSequenceSpecs,
    seed: int,
    pad_id: int,
    fingerprint: str,
    location: Callable[[int], Any],
) -> dict[str, Any]:
    """Format every record of ``index`` (a ``JsonlIndex``), pack, write ``out_path``; returns the metadata."""
    documents = []
    for i in range(len(index)):
        ids, in_loss = format_record(index.record(i), location(i))
        if len(ids) < 2:
            raise DataError(f"{location(i)}: the record gives {len(ids)} token(s); a sample needs at least 2")
        documents.append(document_sample(ids, in_loss))
    packs, meta = pack_documents(documents, specs.packed_sequence_size, seed, pad_id, specs.pad_seq_to_mult or 1)
    meta.update({"fingerprint": fingerprint, "source": index.path, "seed": seed,
                 "pad_seq_to_mult": specs.pad_seq_to_mult or 1})
    write_packed(out_path, packs, meta)
    print_rank_0(f"packed {meta['num_documents']} documents of {index.path} into {meta['num_packs']} packs of "
                 f"{meta['packed_sequence_size']} tokens ({meta['useful_token_fraction']:.1%} useful): {out_path}",
                 logger)
    return meta


# ----------------------------------------------------------------------------------------- reading

def document_layout(doc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The packed-attention inputs of a sequence whose position ``i`` belongs to document ``doc[i]`` (documents
    contiguous): ``position_ids`` restarting at 0 in each document, the ``[P, P]`` bool mask (True = masked,
    Megatron's convention) causal inside each document and blocking everything across documents, and
    ``cu_seqlens`` (each document's first position, then ``P``)."""
    size = doc.shape[0]
    positions = torch.arange(size, device=doc.device)
    starts = torch.ones(size, dtype=torch.bool, device=doc.device)
    starts[1:] = doc[1:] != doc[:-1]
    start_index = torch.where(starts, positions, torch.zeros_like(positions)).cummax(0).values
    causal_block = torch.ones(size, size, dtype=torch.bool, device=doc.device).tril()
    attention_mask = ~(causal_block & (doc[:, None] == doc[None, :]))
    cu = torch.cat([torch.nonzero(starts).view(-1), positions.new_tensor([size])]).to(torch.int32)
    return positions - start_index, attention_mask, cu


def pack_to_sample(pack: np.ndarray, cu_length: Optional[int] = None) -> dict[str, torch.Tensor]:
    """One ``[3, P]`` pack -> tokens, labels, loss_mask, position_ids, attention_mask ``[1, P, P]``, cu_seqlens."""
    tokens = torch.from_numpy(pack[0].astype(np.int64))
    labels = torch.from_numpy(pack[1].astype(np.int64))
    doc = torch.from_numpy(pack[2].astype(np.int64))
    loss_mask = (labels >= 0).to(torch.float32)
    labels = labels.clamp(min=0)
    position_ids, attention_mask, cu = document_layout(doc)
    if cu_length is not None and cu.numel() < cu_length:
        cu = torch.cat([cu, cu[-1:].expand(cu_length - cu.numel())])
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids,
            "attention_mask": attention_mask.unsqueeze(0), "cu_seqlens": cu}


def collate_packs(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack packs; ``cu_seqlens`` of unequal length are padded by repeating their last value."""
    out = {k: torch.stack([s[k] for s in samples]) for k in samples[0] if k != "cu_seqlens"}
    width = max(s["cu_seqlens"].numel() for s in samples)
    out["cu_seqlens"] = torch.stack([
        torch.cat([s["cu_seqlens"], s["cu_seqlens"][-1:].expand(width - s["cu_seqlens"].numel())]) for s in samples
    ])
    return out

