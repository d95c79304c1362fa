"""Sliding-window attention: the mask of a layer whose tokens attend only to the ``window`` most recent positions
(themselves included), and an attention that skips the work outside the window on long sequences.

Semantics (exactly HF's ``sliding_window`` and Megatron's ``window_size=(window - 1, 0)``, see
``longspan.models.layer_pattern``): a query at position i attends to the key at position j when
``0 <= i - j < window``.

Keys are **bottom-right aligned** with the queries: the last key is at the last query's position and keys are
contiguous. That holds for training (queries = keys) and for a KV cache (cached keys, then the new ones), and
lets one mask serve a cache that keeps only the window (``KVCache`` for local layers): no absolute offsets.

A caller's mask (Megatron's bool, True = masked: document boundaries of packed sequences, a KV cache's causal
mask) is combined with the window: a key is attended only if both allow it. When the caller's mask has more key
columns than the keys at hand (a KV cache that kept only the window), its last columns are the ones used.

A ``TwoSidedMask`` is a caller's mask that may let a query see later keys (Gemma 3's image tokens see their whole
image): the window then cuts only the keys too far back (``i - j >= window``) and the caller's mask decides the
later ones, as transformers' Gemma 3 does (its sliding mask is AND(window, OR(causal, image block))).

Cost: on a sequence of ``s`` tokens the dense path builds an ``[s, s]`` mask and lets SDPA compute every score;
``windowed_attention`` instead cuts the queries into chunks of ``max(window, MIN_CHUNK)`` and attends each chunk
only to the keys its window reaches (at most ``chunk + window - 1``), so time and memory grow with
``s · (chunk + window)`` instead of ``s²``. Both are exact: the skipped scores are masked scores.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

#: the smallest query chunk of the block-local path (a small window still gets chunks of this many queries,
#: so the per-chunk kernel calls stay few)
MIN_CHUNK = 256


class TwoSidedMask:
    """A caller's attention mask (bool ``[b or 1, 1, s_q, s_k]``, True = masked) that decides later keys itself:
    it may unmask keys after the query. Full-attention layers receive ``mask`` as it is; sliding-window layers
    combine it with only the far edge of their window (``WindowedMask(causal=False)``). With ``sliding_only``
    the full-attention layers receive ``full_layers`` instead (None: causal), as transformers' Gemma 4 keeps
    its full-attention layers causal over images."""

    __slots__ = ("mask", "sliding_only", "full_layers")

    def __init__(self, mask: torch.Tensor, sliding_only: bool = False,
                 full_layers: torch.Tensor | None = None) -> None:
        self.mask = mask
        self.sliding_only = sliding_only
        self.full_layers = full_layers


class WindowedMask:
    """What a sliding-window layer receives as its ``attention_mask``: the window, the caller's mask (or None)
    and a memo shared by every layer of one forward, so each distinct (window, shape) mask is built once per
    forward, not per layer. ``causal=False`` (a ``TwoSidedMask``'s): the window masks only keys too far back and
    the caller's mask, required then, decides the later keys."""

    __slots__ = ("window", "base", "memo", "causal")

    def __init__(self, window: int, base: torch.Tensor | None, memo: dict[Any, torch.Tensor] | None = None,
                 causal: bool = True) -> None:
        if base is not None and base.dtype != torch.bool:  # a 0/1 (or additive 0/-inf) mask: non-zero is masked
            base = base != 0
        if not causal and base is None:
            raise ValueError("a sliding-window mask without its causal part needs the caller's mask")
        self.window = int(window)
        self.base = base
        self.memo = {} if memo is None else memo
        self.causal = causal

    def aligned_base(self, q_len: int, k_len: int) -> torch.Tensor | None:
        """The caller's mask for ``q_len`` queries and the last ``k_len`` key positions (bottom-right)."""
        base = self.base
        if base is None:
            return None
        if base.shape[-2] != q_len:
            raise ValueError(f"attention mask has {base.shape[-2]} query rows for {q_len} queries")
        return base[..., base.shape[-1] - k_len:] if base.shape[-1] != k_len else base

    def band(self, q_len: int, k_len: int, first: int, device: torch.device) -> torch.Tensor:
        """The window's mask ``[q_len, k_len]`` (True = masked) when query i sits at key index ``first + i``."""
        key = ("band", self.window, q_len, k_len, first, device, self.causal)
        mask = self.memo.get(key)
        if mask is None:
            mask = band_mask(q_len, k_len, self.window, first, device, causal=self.causal)
            self.memo[key] = mask
        return mask

    def dense_keep(self, q_len: int, k_len: int, device: torch.device) -> torch.Tensor:
        """Window and caller's mask together as SDPA's ``attn_mask`` (True = attend), ``[b or 1, 1, q_len,
        k_len]``; built once per forward."""
        key = ("dense", self.window, q_len, k_len, device, self.causal)
        keep = self.memo.get(key)
        if keep is None:
            band = self.band(q_len, k_len, k_len - q_len, device)
            keep = ~_combine(band, self.aligned_base(q_len, k_len))
            self.memo[key] = keep
        return keep

    def __repr__(self) -> str:
        base = None if self.base is None else tuple(self.base.shape)
        return f"WindowedMask(window={self.window}, base={base}, causal={self.causal})"


def _combine(band: torch.Tensor, base: torch.Tensor | None) -> torch.Tensor:
    return band[None, None] if base is None else band[None, None] | base


def band_mask(
    q_len: int, k_len: int, window: int, first: int, device: torch.device | str | None = None, causal: bool = True
) -> torch.Tensor:
    """Bool ``[q_len, k_len]``, True = masked: query i (at key index ``first + i``) sees keys j with
    ``0 <= first + i - j < window`` (``causal=False``: every j with ``first + i - j < window``)."""
    distance = (torch.arange(q_len, device=device) + first)[:, None] - torch.arange(k_len, device=device)[None, :]
    return ((distance < 0) | (distance >= window)) if causal else distance >= window


def windowed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: WindowedMask,
    dropout_p: float = 0.0,
    scale: float | None = None,
    base: torch.Tensor | None | str = "aligned",
) -> torch.Tensor:
    """Sliding-window attention of ``q`` ``[b, heads, sq, d]`` to bottom-right aligned ``k``/``v``
    ``[b, heads, sk, d]`` (kv heads already repeated), with ``mask``'s window and caller's mask.

    ``base``: the caller's mask already cut to these queries and keys (``[b or 1, 1, sq, sk]`` or None); by
    default ``mask.aligned_base(sq, sk)``. Long sequences run block-local (see the module docstring).
    """
    q_len, k_len = q.shape[2], k.shape[2]
    window = mask.window
    own_base = isinstance(base, str)  # the caller's mask of ``mask``: its combinations are memoized
    if own_base:
        base = mask.aligned_base(q_len, k_len)
    first = k_len - q_len  # the key index of the first query's position
    if base is None and q_len == k_len and window >= k_len:
        # the window reaches every earlier key: plain causal attention (SDPA's is_causal fast path)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale)
    chunk = max(window, MIN_CHUNK)
    # a two-sided mask may reach keys after a chunk's end, which the block-local path never looks at
    if q_len <= chunk or k_len <= chunk + window - 1 or not mask.causal:
        if own_base:
            keep = mask.dense_keep(q_len, k_len, q.device)
        else:
            keep = ~_combine(mask.band(q_len, k_len, first, q.device), base)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=dropout_p, scale=scale)
    # Chunks are cut with split (whose backward is one concatenation) and each chunk's keys are its own key piece
    # plus the tail of the previous one (a window never reaches further: chunk >= window), so the backward
    # costs O(sequence), not a zero-filled full-length gradient per chunk as slicing the whole K/V would.
    q_pieces = q.split(chunk, dim=2)
    k_prefix, v_prefix = k[:, :, :first], v[:, :, :first]
    k_pieces, v_pieces = k[:, :, first:].split(chunk, dim=2), v[:, :, first:].split(chunk, dim=2)
    outs = []
    for j, start in enumerate(range(0, q_len, chunk)):
        end = min(start + chunk, q_len)
        prev_k, prev_v = (k_pieces[j - 1], v_pieces[j - 1]) if j > 0 else (k_prefix, v_prefix)
        tail = min(window - 1, prev_k.shape[2])
        keys = torch.cat([prev_k[:, :, prev_k.shape[2] - tail:], k_pieces[j]], dim=2)
        values = torch.cat([prev_v[:, :, prev_v.shape[2] - tail:], v_pieces[j]], dim=2)
        key_start, key_end = first + start - tail, first + end
        # interior chunks without a caller's mask share one key (the same relative band)
        memo_key = (("chunk", window, q_len, k_len, start, q.device) if base is not None
                    else ("chunk", window, end - start, key_end - key_start, first + start - key_start, q.device))
        keep = mask.memo.get(memo_key) if own_base or base is None else None
        if keep is None:
            band = mask.band(end - start, key_end - key_start, first + start - key_start, q.device)
            keep = ~_combine(band, None if base is None else base[..., start:end, key_start:key_end])
            if own_base or base is None:
                mask.memo[memo_key] = keep
        outs.append(F.scaled_dot_product_attention(q_pieces[j], keys, values, attn_mask=keep, dropout_p=dropout_p,
                                                    scale=scale))
    return torch.cat(outs, dim=2)


__all__ = ["MIN_CHUNK", "TwoSidedMask", "WindowedMask", "band_mask", "windowed_attention"]
