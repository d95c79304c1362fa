"""The all-to-all between sequence chunks and heads that context parallel uses for sequence mixers that run
along the whole sequence per head (Mamba-2's SSD scan, gated DeltaNet's delta rule, their causal convs).

Under context parallel rank ``r`` holds two load-balanced chunks of every sequence (chunks ``r`` and
``2·cp−1−r``, see ``longspan.parallel.context_parallel``). ``HeadsExchange.to_heads`` hands rank ``j`` every
rank's tokens of channel share ``j`` of each projected segment and puts them in sequence order: each rank then
holds the **whole sequence, in order, for ``1/cp`` of the heads**; ``to_sequence`` is the inverse for the mixer's
output. Each all-to-all's backward is the same exchange in reverse, so gradients are exact. The segments'
channels must be head-major (a share of the channels is a share of the heads).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist


def chunks_to_sequence(parts: list[torch.Tensor]) -> torch.Tensor:
    """Rank r's ``[chunk r, chunk 2cp−1−r]`` (ranks in order; the load balancing of context_parallel.py)
    -> the sequence in order, along dim 1."""
    cp = len(parts)
    chunks: list[Any] = [None] * (2 * cp)
    for r, part in enumerate(parts):
        chunks[r], chunks[2 * cp - 1 - r] = part.chunk(2, dim=1)
    return torch.cat(chunks, dim=1)


def sequence_to_chunks(whole: torch.Tensor, cp: int) -> list[torch.Tensor]:
    """The inverse of ``chunks_to_sequence``: every rank's two chunks of ``whole`` (dim 1)."""
    chunks = whole.chunk(2 * cp, dim=1)
    return [torch.cat([chunks[r], chunks[2 * cp - 1 - r]], dim=1) for r in range(cp)]


class _AllToAll(torch.autograd.Function):
    """``out[i] = rank i's in[me]`` over dim 0 (``[cp, ...]``); its own inverse, so also its backward."""

    @staticmethod
    def forward(ctx: Any, blocks: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _all_to_all(blocks, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_to_all(grad, ctx.group), None


def _all_to_all(blocks: torch.Tensor, group: Any) -> torch.Tensor:
    blocks = blocks.contiguous()
    out = torch.empty_like(blocks)
    dist.all_to_all_single(out, blocks, group=group)
    return out


class HeadsExchange:
    """The two exchanges over a cp ``group`` (a plain object, no parameters). Subclasses add ``heads_of``, the
    mixer's parameters cut to this rank's share of the heads."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)

    def share(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's share of ``t``'s rows (dim 0: heads, or head-major channels)."""
        return t.chunk(self.size, dim=0)[self.rank]

    def to_heads(self, segments: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """This rank's load-balanced chunks ``[b, s/cp, n_k]`` of each segment -> the whole sequence, in order,
        of share ``rank`` of each segment's channels ``[b, s, n_k/cp]``. The segments share one dtype."""
        cp = self.size
        shares = [segment.chunk(cp, dim=-1) for segment in segments]
        blocks = torch.stack([torch.cat([share[j] for share in shares], dim=-1) for j in range(cp)])
        received = _AllToAll.apply(blocks, self.group)  # [cp (source rank), b, s/cp, sum n_k/cp]
        whole = chunks_to_sequence(list(received.unbind(0)))
        return list(whole.split([segment.shape[-1] // cp for segment in segments], dim=-1))

    def to_sequence(self, y: torch.Tensor) -> torch.Tensor:
        """The inverse for the mixer's output: ``[b, s, d/cp]`` of this rank's channels -> ``[b, s/cp, d]``,
        this rank's tokens of every channel (in channel order)."""
        blocks = torch.stack(sequence_to_chunks(y, self.size))
        return torch.cat(_AllToAll.apply(blocks, self.group).unbind(0), dim=-1)
