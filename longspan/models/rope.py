"""Rotary position embeddings (RoPE) in Megatron's non-interleaved "rotate_half" layout.

The layout is the one Megatron Core and HF Llama use: the rotated part of each head is split into two
halves ``[x1, x2]`` and rotated as ``[x1*cos - x2*sin, x2*cos + x1*sin]``. With ``rotary_percent < 1`` only
the first ``int(head_dim * rotary_percent)`` channels of each head rotate; the rest pass through.

The module holds no parameters and no buffers, so a model built on the meta device needs nothing special to
materialize it: the inverse frequencies are recomputed (cheaply, ``rot_dim / 2`` numbers) per device.
"""

from __future__ import annotations

import math

import torch
from torch import nn

# Llama-3 frequency scaling constants (Megatron Core's and Meta's defaults; only the factor is configurable).
LLAMA3_LOW_FREQ_FACTOR = 1.0
LLAMA3_HIGH_FREQ_FACTOR = 4.0
LLAMA3_ORIGINAL_MAX_POSITIONS = 8192


def llama3_scale_inv_freq(
    inv_freq: torch.Tensor,
    factor: float = 8.0,
    low_freq_factor: float = LLAMA3_LOW_FREQ_FACTOR,
    high_freq_factor: float = LLAMA3_HIGH_FREQ_FACTOR,
    original_max_positions: int = LLAMA3_ORIGINAL_MAX_POSITIONS,
) -> torch.Tensor:
    """Llama-3.1 RoPE scaling: long wavelengths are divided by ``factor``, short ones kept, medium blended."""
    low_freq_wavelen = original_max_positions / low_freq_factor
    high_freq_wavelen = original_max_positions / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_positions / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Computes ``(cos, sin)`` tables for given position ids.

    Args:
        head_dim: channels per attention head (``kv_channels``).
        rotary_percent: fraction of each head's channels that rotate.
        rotary_base: the RoPE base (theta).
        rope_scaling: apply Llama-3 frequency scaling.
        rope_scaling_factor: the Llama-3 scaling factor.
        low_freq_factor, high_freq_factor, original_max_positions: the other Llama-3 scaling constants.
        seq_len_interpolation_factor: divide positions by this (linear position interpolation); None = off.
    """

    def __init__(
        self,
        head_dim: int,
        rotary_percent: float = 1.0,
        rotary_base: float = 10000.0,
        rope_scaling: bool = False,
        rope_scaling_factor: float = 8.0,
        low_freq_factor: float = LLAMA3_LOW_FREQ_FACTOR,
        high_freq_factor: float = LLAMA3_HIGH_FREQ_FACTOR,
        original_max_positions: int = LLAMA3_ORIGINAL_MAX_POSITIONS,
        seq_len_interpolation_factor: float | None = None,
    ) -> None:
        super().__init__()
        rot_dim = int(head_dim * rotary_percent) if rotary_percent < 1.0 else head_dim
        self.rot_dim = rot_dim
        self.rotary_base = float(rotary_base)
        self.rope_scaling = rope_scaling
        self.rope_scaling_factor = float(rope_scaling_factor)
        self.low_freq_factor = float(low_freq_factor)
        self.high_freq_factor = float(high_freq_factor)
        self.original_max_positions = int(original_max_positions)
        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        self._inv_freq_cache: dict[torch.device, torch.Tensor] = {}

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        """Inverse frequencies ``[rot_dim // 2]`` in float32 on ``device`` (cached per device)."""
        cached = self._inv_freq_cache.get(device)
        if cached is None:
            # float32 on the CPU, exactly as Megatron Core and HF compute it, so every device (and both
            # references) sees bit-identical frequencies; positions in the thousands amplify any rounding.
            exponents = torch.arange(0, self.rot_dim, 2, dtype=torch.float32) / self.rot_dim
            inv = 1.0 / (self.rotary_base**exponents)
            if self.rope_scaling:
                inv = llama3_scale_inv_freq(
                    inv,
                    factor=self.rope_scaling_factor,
                    low_freq_factor=self.low_freq_factor,
                    high_freq_factor=self.high_freq_factor,
                    original_max_positions=self.original_max_positions,
                )
            cached = inv.to(device)
            self._inv_freq_cache[device] = cached
        return cached

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``position_ids [b, s]`` -> ``(cos, sin)``, each float32 ``[b, s, 1, rot_dim]`` (broadcast over heads)."""
        inv = self.inv_freq(position_ids.device)
        positions = position_ids.float()
        if self.seq_len_interpolation_factor is not None:
            positions = positions / self.seq_len_interpolation_factor
        freqs = positions.unsqueeze(-1) * inv  # [b, s, rot_dim/2]
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(2)  # [b, s, 1, rot_dim]
        return emb.cos(), emb.sin()


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` with its first half negated, so that ``x * cos + x.roll(rot_dim // 2, -1) * signed_sin(sin)``
    equals (bit for bit) the rotate_half form ``x * cos + cat(-x2, x1) * sin``: one roll instead of a
    chunk, a negation and a cat, forward and backward. Compute it once per table and pass it to
    ``apply_rotary`` for every tensor rotated with that table."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, sin_signed: torch.Tensor | None = None
) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` channels of every head of ``x [b, s, heads, head_dim]``.

    ``cos``/``sin`` are cast to ``x``'s dtype first, as Megatron and HF do. ``sin_signed`` is
    ``signed_sin(sin)`` when the caller has it already (e.g. shared by queries and keys).
    """
    rot_dim = cos.shape[-1]
    cos = cos.to(x.dtype)
    sin_signed = (signed_sin(sin) if sin_signed is None else sin_signed).to(x.dtype)
    if rot_dim == x.shape[-1]:
        return x * cos + x.roll(rot_dim // 2, dims=-1) * sin_signed
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    return torch.cat((x_rot * cos + x_rot.roll(rot_dim // 2, dims=-1) * sin_signed, x_pass), dim=-1)


class LinearScaledRotaryEmbedding(RotaryEmbedding):
    """``RotaryEmbedding`` whose inverse frequencies are divided by ``linear_factor`` (HF's ``linear`` rope type,
    computed as HF does: the plain frequencies, then the division). Gemma 3's global layers use it, with their
    own base, next to the local layers' plain table."""

    def __init__(self, head_dim: int, linear_factor: float, **kwargs) -> None:
        super().__init__(head_dim, **kwargs)
        self.linear_factor = float(linear_factor)
        self._scaled_cache: dict[torch.device, torch.Tensor] = {}

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        cached = self._scaled_cache.get(device)
        if cached is None:
            cached = super().inv_freq(device) / self.linear_factor  # IEEE division: the same on every device
            self._scaled_cache[device] = cached
        return cached
