"""Multimodal RoPE (mRoPE, Qwen2-VL / Qwen2.5-VL): rotary embeddings over three position axes.

Every token has three position ids, temporal / height / width (``position_ids [3, b, s]``). Text tokens carry
the same number on all three; the tokens of an image carry their patch row and column (offset by the text
before them) on the height and width axes. The rotary frequencies are split into three consecutive sections
(``mrope_section``, in frequency pairs, summing to ``head_dim / 2``): section k rotates by axis k's position.
The tables then have the usual rotate-half layout, so ``longspan.models.rope.apply_rotary`` applies them.
"""

from __future__ import annotations

from typing import Sequence

import torch

from longspan.core.errors import DataError
from longspan.models.rope import RotaryEmbedding


class MultimodalRotaryEmbedding(RotaryEmbedding):
    """``RotaryEmbedding`` whose positions are ``[3, b, s]`` (temporal, height, width); a ``[b, s]`` input means
    the same position on all three axes (text only)."""

    def __init__(self, head_dim: int, mrope_section: Sequence[int], rotary_base: float = 10000.0) -> None:
        super().__init__(head_dim, rotary_base=rotary_base)
        self.mrope_section = [int(n) for n in mrope_section]
        if len(self.mrope_section) != 3 or sum(self.mrope_section) != self.rot_dim // 2:
            raise ValueError(f"mrope_section={self.mrope_section} must be 3 sizes summing to {self.rot_dim // 2}")

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``position_ids [3, b, s]`` (or ``[b, s]``) -> ``(cos, sin)``, each float32 ``[b, s, 1, head_dim]``."""
        if position_ids.dim() == 2:
            position_ids = position_ids.unsqueeze(0).expand(3, -1, -1)
        freqs = position_ids.float().unsqueeze(-1) * self.inv_freq(position_ids.device)  # [3, b, s, d/2]
        sections = freqs.split(self.mrope_section, dim=-1)
        mixed = torch.cat([section[axis] for axis, section in enumerate(sections)], dim=-1)  # [b, s, d/2]
        emb = torch.cat((mixed, mixed), dim=-1).unsqueeze(2)
        return emb.cos(), emb.sin()


def image_token_count(grid_thw: Sequence[int], spatial_merge_size: int) -> int:
    """How many LM tokens one image (or video) of patch grid ``(t, h, w)`` becomes after the patch merger."""
    t, h, w = (int(n) for n in grid_thw)
    return t * (h // spatial_merge_size) * (w // spatial_merge_size)


def _runs(row: torch.Tensor, image_token_id: int, documents: Sequence[int] = ()) -> list[tuple[bool, int, int]]:
    """(is image token, start, end) of the maximal runs of ``row``, also cut at the ``documents``' first
    positions (so no run spans two packed documents)."""
    is_image = (row == image_token_id).to(torch.int8)
    bounds = set((torch.nonzero(is_image[1:] != is_image[:-1]).flatten() + 1).tolist())
    bounds = sorted(bounds | {int(d) for d in documents if 0 < int(d) < row.numel()})
    starts, ends = [0, *bounds], [*bounds, row.numel()]
    flags = is_image[starts].tolist() if row.numel() else []
    return [(bool(f), s, e) for f, s, e in zip(flags, starts, ends)]


def mrope_position_ids(
    input_ids: torch.Tensor,
    image_grid_thw: torch.Tensor | None,
    image_token_id: int,
    spatial_merge_size: int,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The mRoPE position ids of a batch, as transformers' Qwen2.5-VL ``get_rope_index`` numbers them.

    Text tokens count up on all three axes. An image's tokens (``image_token_id``, one per merged patch, row
    after row) start where the text before them stopped: temporal axis constant, height and width axes the
    patch row and column added to it; the text after the image continues from the start plus the image's
    larger side (in merged patches). ``image_grid_thw [n, 3]`` holds the patch grids of the batch's images in
    order (row after row); adjacent images are told apart by their token counts. With ``cu_seqlens [b, n + 1]``
    (packed documents: each one's first position, then the row's length, repeated values allowed) every document
    is numbered as if it were its own row, from 0; its images are still taken from ``image_grid_thw`` in order.

    Returns ``(position_ids [3, b, s], deltas [b, 1])``: ``deltas`` is the highest position + 1 minus the
    length, which the positions of tokens generated after the prompt are shifted by.
    A mismatch between image tokens and ``image_grid_thw`` is a one-line ``DataError`` naming the row.
    """
    batch, seq = input_ids.shape
    device = input_ids.device
    grids = [] if image_grid_thw is None else [tuple(int(n) for n in g) for g in image_grid_thw.tolist()]
    next_grid = 0
    positions = torch.zeros(3, batch, seq, dtype=torch.long, device=device)
    deltas = torch.zeros(batch, 1, dtype=torch.long, device=device)
    for b in range(batch):
        pieces, current = [], 0
        documents = set() if cu_seqlens is None else {int(d) for d in cu_seqlens[b].tolist()}
        for is_image, start, end in _runs(input_ids[b], image_token_id, sorted(documents)):
            if start in documents:
                current = 0
            if not is_image:
                pieces.append(torch.arange(end - start, device=device).expand(3, -1) + current)
                current += end - start
                continue
            cursor = start
            while cursor < end:
                if next_grid >= len(grids):
                    raise DataError(f"row {b}: {end - cursor} image tokens at position {cursor} have no image "
                                    f"left ({len(grids)} images in image_grid_thw)")
                t, h, w = grids[next_grid]
                count = image_token_count((t, h, w), spatial_merge_size)
                if cursor + count > end:
                    raise DataError(f"row {b}: image {next_grid} (grid {t}x{h}x{w}) needs {count} image tokens, "
                                    f"the prompt has {end - cursor} at position {cursor}")
                gh, gw = h // spatial_merge_size, w // spatial_merge_size
                tt = torch.arange(t, device=device).view(t, 1, 1).expand(t, gh, gw)
                hh = torch.arange(gh, device=device).view(1, gh, 1).expand(t, gh, gw)
                ww = torch.arange(gw, device=device).view(1, 1, gw).expand(t, gh, gw)
                pieces.append(torch.stack([tt, hh, ww]).reshape(3, -1) + current)
                current += max(gh, gw)
                cursor += count
                next_grid += 1
        row = torch.cat(pieces, dim=1) if pieces else positions.new_zeros(3, 0)
        positions[:, b] = row
        deltas[b, 0] = (int(row.max()) + 1 - seq) if seq else 0
    if next_grid != len(grids):
        raise DataError(f"image_grid_thw holds {len(grids)} images but the tokens have image tokens for "
                        f"{next_grid}: each image needs its image tokens")
    return positions, deltas
