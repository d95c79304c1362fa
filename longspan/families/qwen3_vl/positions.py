"""Qwen3-VL's position numbering: interleaved multimodal RoPE, and the mRoPE position ids of prompts with images
and videos.

Interleaved mRoPE: the rotary frequency pairs take their position from the three axes in turn (pair ``i`` from
the height axis when ``i % 3 == 1`` and ``i < 3 * mrope_section[1]``, from the width axis when ``i % 3 == 2`` and
``i < 3 * mrope_section[2]``, from the temporal axis otherwise), where Qwen2.5-VL gives each axis a block of
consecutive pairs (``longspan.models.vlm.mrope``). Every pair has an axis whatever the sections sum to (as in
transformers: Qwen3.5's default [11, 11, 10] on a smaller head simply stops early).

Position ids: images are numbered as Qwen2.5-VL numbers them; a video is numbered frame by frame (each temporal
patch is its own grid of height and width, as the processor writes a timestamp before each), so the shared
numbering applies once each frame is read as an image of one temporal patch.
"""

from __future__ import annotations

from typing import Sequence

import torch

from longspan.core.errors import DataError
from longspan.models.rope import RotaryEmbedding
from longspan.models.vlm.mrope import image_token_count, mrope_position_ids


class InterleavedMultimodalRotaryEmbedding(RotaryEmbedding):
    """``RotaryEmbedding`` whose positions are ``[3, b, s]`` (temporal, height, width; a ``[b, s]`` input means
    the same position on all three axes), the axes interleaved pair by pair (Qwen3-VL, Qwen3.5)."""

    def __init__(self, head_dim: int, mrope_section: Sequence[int], rotary_base: float = 10000.0) -> None:
        super().__init__(head_dim, rotary_base=rotary_base)
        self.mrope_section = [int(n) for n in mrope_section]
        if len(self.mrope_section) != 3:
            raise ValueError(f"mrope_section={self.mrope_section} must be 3 sizes")

    def axis_of_pair(self) -> torch.Tensor:
        """The position axis (0 temporal, 1 height, 2 width) of each frequency pair ``[head_dim / 2]``."""
        pairs = torch.arange(self.rot_dim // 2)
        axis = torch.zeros_like(pairs)
        for which in (1, 2):
            axis[(pairs % 3 == which) & (pairs < 3 * self.mrope_section[which])] = which
        return axis

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``position_ids [3, b, s]`` (or ``[b, s]``) -> ``(cos, sin)``, each float32 ``[b, s, 1, head_dim]``."""
        if position_ids.dim() == 2:
            position_ids = position_ids.unsqueeze(0).expand(3, -1, -1)
        freqs = position_ids.float().unsqueeze(-1) * self.inv_freq(position_ids.device)  # [3, b, s, d/2]
        axis = self.axis_of_pair().to(position_ids.device)
        mixed = freqs.gather(0, axis.view(1, 1, 1, -1).expand(1, *freqs.shape[1:]))[0]  # [b, s, d/2]
        emb = torch.cat((mixed, mixed), dim=-1).unsqueeze(2)
        return emb.cos(), emb.sin()


def frame_grids(video_grid_thw: torch.Tensor | None) -> list[tuple[int, int, int]]:
    """Each video's grid ``(t, h, w)`` as t grids ``(1, h, w)``: one per temporal patch, in order."""
    if video_grid_thw is None:
        return []
    return [(1, int(h), int(w)) for t, h, w in video_grid_thw.tolist() for _ in range(int(t))]


def vision_grids_in_order(input_ids: torch.Tensor, image_grid_thw: torch.Tensor | None,
                          video_grid_thw: torch.Tensor | None, image_token_id: int, video_token_id: int,
                          merge: int) -> list[tuple[int, int, int]]:
    """The image grids and the videos' frame grids merged in the order their tokens appear (row after row)."""
    images = [] if image_grid_thw is None else [tuple(int(n) for n in g) for g in image_grid_thw.tolist()]
    sources = {image_token_id: images, video_token_id: frame_grids(video_grid_thw)}
    taken = {image_token_id: 0, video_token_id: 0}
    merged = []
    for row in input_ids.tolist():
        start = 0
        while start < len(row):
            token = row[start]
            end = start
            while end < len(row) and row[end] == token:
                end += 1
            if token in sources:
                left, grids = end - start, sources[token]
                while left > 0 and taken[token] < len(grids):
                    grid = grids[taken[token]]
                    merged.append(grid)
                    taken[token] += 1
                    left -= image_token_count(grid, merge)
            start = end
    for token, grids in sources.items():  # grids without tokens: the numbering's count check reports them
        merged += grids[taken[token]:]
    return merged


def qwen3_vl_position_ids(input_ids: torch.Tensor, image_grid_thw: torch.Tensor | None,
                          video_grid_thw: torch.Tensor | None, image_token_id: int, video_token_id: int,
                          merge: int, cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(position_ids [3, b, s], deltas [b, 1])`` as transformers' Qwen3-VL ``get_rope_index`` numbers them
    (packed documents, ``cu_seqlens``, each from 0: ``mrope_position_ids``); a mismatch between the vision tokens
    and the grids is a one-line ``DataError``."""
    grids = vision_grids_in_order(input_ids, image_grid_thw, video_grid_thw, image_token_id, video_token_id, merge)
    as_images = torch.where(input_ids == video_token_id, torch.full_like(input_ids, image_token_id), input_ids)
    table = torch.tensor(grids, dtype=torch.long).view(-1, 3) if grids else None
    try:
        return mrope_position_ids(as_images, table, image_token_id, merge, cu_seqlens)
    except DataError as exc:
        raise DataError(f"{exc} (images and video frames counted together)") from None
