"""In-batch packing (Megatron Bridge's ``enable_in_batch_packing`` of the direct HF SFT data): the samples of one
microbatch become one sequence, with no attention between them.

Each sample keeps its own tokens, labels, loss flags and positions (0, 1, ...) and is padded to a multiple of
``in_batch_packing_pad_to_multiple_of`` (pad id, loss 0, positions counting on); the samples are laid end to
end in microbatch order, so a packed microbatch is ``[1, T]`` with ``T`` the sum of the padded lengths (the
"emergent width": ``pad_to_max_length`` and ``pad_to_multiple_of`` do not apply to it)::

    samples (pad_to_multiple_of=4)   a a a | b b b b b | c c
    packed                           a a a _ b b b b b _ _ _ c c _ _
    position_ids                     0 1 2 3 0 1 2 3 4 5 6 7 0 1 2 3
    cu_seqlens                       [0, 4, 12, 16]

The batch then takes the offline packs' path (``longspan.data.sft.packing.document_layout``): a ``[1, 1, T, T]``
block-diagonal causal ``attention_mask`` and ``cu_seqlens`` (each sample's first position, then ``T``), so each
sample's logits, and the microbatch's loss sum and loss-token count, are those of the unpacked microbatch.

Packing happens in the collate function, or (``defer_in_batch_packing_to_step``) in the training step: the
collate then pads the microbatch as usual and adds ``sequence_lengths``, and the forward step packs it
(``pack_padded_batch``) after moving it to the device; both give the same batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from longspan.data.sft.packing import document_layout

PACKED_ROW_KEYS = ("tokens", "labels", "loss_mask")


@dataclass(frozen=True)
class InBatchPacking:
    """How a dataset's microbatches are packed: each sample padded to ``pad_to_multiple_of``; ``deferred``
    leaves the packing to the training step (the collate pads and adds ``sequence_lengths``)."""

    pad_to_multiple_of: int = 1
    deferred: bool = False


def pack_rows(rows: list[dict[str, torch.Tensor]], pad_id: int, pad_to_multiple_of: int) -> dict[str, torch.Tensor]:
    """Samples (1-D ``tokens``, ``labels``, ``loss_mask`` of their real length) -> one packed ``[1, T]`` batch
    with ``position_ids``, ``attention_mask`` ``[1, 1, T, T]`` and ``cu_seqlens`` ``[1, n + 1]``."""
    multiple = max(1, int(pad_to_multiple_of))
    lengths = [int(row["tokens"].numel()) for row in rows]
    padded = [-(-n // multiple) * multiple for n in lengths]
    total = sum(padded)
    first = rows[0]["tokens"]
    tokens = torch.full((total,), pad_id, dtype=first.dtype, device=first.device)
    labels = torch.full((total,), pad_id, dtype=rows[0]["labels"].dtype, device=first.device)
    loss_mask = torch.zeros(total, dtype=rows[0]["loss_mask"].dtype, device=first.device)
    doc = torch.empty(total, dtype=torch.long, device=first.device)
    offset = 0
    for number, (row, n, p) in enumerate(zip(rows, lengths, padded)):
        tokens[offset: offset + n] = row["tokens"]
        labels[offset: offset + n] = row["labels"]
        loss_mask[offset: offset + n] = row["loss_mask"]
        doc[offset: offset + p] = number
        offset += p
    position_ids, attention_mask, cu_seqlens = document_layout(doc)
    return {"tokens": tokens[None], "labels": labels[None], "loss_mask": loss_mask[None],
            "position_ids": position_ids[None], "attention_mask": attention_mask[None, None],
            "cu_seqlens": cu_seqlens[None], "real_tokens": torch.tensor(lengths, dtype=torch.long)}


def pack_padded_batch(batch: dict[str, torch.Tensor], pad_id: int, pad_to_multiple_of: int) -> dict[str, torch.Tensor]:
    """A right-padded microbatch ``[b, s]`` with ``sequence_lengths`` ``[b]`` -> the packed batch of
    ``pack_rows`` (the deferred packing of the training step); other keys are dropped."""
    lengths = batch["sequence_lengths"].tolist()
    rows = [{key: batch[key][i, : int(n)] for key in PACKED_ROW_KEYS} for i, n in enumerate(lengths)]
    return pack_rows(rows, pad_id, pad_to_multiple_of)
