"""Rotary position embeddings (RoPE) and their frequency scalings.

Layout: Megatron's and HF Llama's non-interleaved "rotate_half" form by default: the rotated part of each head
is split into two halves ``[x1, x2]`` and rotated as ``[x1*cos - x2*sin, x2*cos + x1*sin]``. With
``interleaved`` (Megatron's ``rotary_interleaved``) channel pairs ``(x0, x1), (x2, x3), ...`` rotate instead and
the tables repeat each frequency twice in a row. With ``rotary_percent < 1`` only the first
``int(head_dim * rotary_percent)`` channels of each head rotate; the rest pass through.

Frequency scalings (HF ``rope_parameters["rope_type"]`` semantics, transformers' ``modeling_rope_utils``):

- ``linear`` (``seq_len_interpolation_factor``): every inverse frequency divided by the factor (the same as
  dividing the positions, computed on the frequencies as transformers does);
- ``llama3``: long wavelengths divided by the factor, short ones kept, medium ones blended;
- ``yarn``: NTK-by-parts blend of interpolated and extrapolated frequencies between the ``beta_fast`` /
  ``beta_slow`` correction range, and cos/sin scaled by the attention factor (mscale);
- ``dynamic`` (NTK-aware): the base grows with the sequence length once it exceeds the original length;
- ``longrope``: per-frequency factors, the short set up to the original length, the long set beyond, and
  cos/sin scaled by the attention factor.

``dynamic`` and ``longrope`` depend on the sequence: each forward uses the length ``max(position_ids) + 1``
(transformers' rule). In incremental decoding that is the length so far, so with a KV cache the keys already
cached keep the frequencies they were computed with (as in transformers' cached ``generate``); see
``RotaryEmbedding.reencode_from`` for LongRoPE's switch.

The module holds no parameters and no buffers, so a model built on the meta device needs nothing special to
materialize it: the inverse frequencies are recomputed (cheaply, ``rot_dim / 2`` numbers) per device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

if TYPE_CHECKING:  # the arguments module imports this one
    from longspan.models.args import TransformerArgs

# Defaults of the frequency-band scaling (HF rope_type 'llama3': Megatron Core's and Meta's; only the factor is
# configurable).
BAND_LOW_FREQ_FACTOR = 1.0
BAND_HIGH_FREQ_FACTOR = 4.0
BAND_ORIGINAL_MAX_POSITIONS = 8192

#: The HF rope_type names longspan implements (besides "default").
ROPE_SCALING_TYPES = ("linear", "dynamic", "yarn", "longrope", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """One sequence-independent or sequence-dependent frequency scaling (``kind``) and its constants.

    ``kind`` is 'llama3', 'yarn', 'dynamic' or 'longrope' (``linear`` is ``seq_len_interpolation_factor``, which
    composes with any of them). Fields a kind does not use are ignored.
    """

    kind: str
    factor: float = 1.0
    """llama3 / yarn / dynamic: the scaling factor."""
    original_max_positions: int = BAND_ORIGINAL_MAX_POSITIONS
    """The pretraining context length: llama3's and yarn's correction ranges, dynamic's and longrope's switch."""
    low_freq_factor: float = BAND_LOW_FREQ_FACTOR
    high_freq_factor: float = BAND_HIGH_FREQ_FACTOR
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    truncate: bool = True
    """yarn: round the correction range outwards to whole dimensions."""
    short_factor: Optional[tuple[float, ...]] = None
    long_factor: Optional[tuple[float, ...]] = None
    attention_factor: Optional[float] = None
    """yarn / longrope: the cos/sin scale; None = yarn's mscale ratio (longrope needs it set)."""

    def attention_scaling(self) -> float:
        """The factor cos and sin are multiplied by."""
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.kind == "yarn":
            # Megatron Core's mscale ratio; with mscale_all_dim=0 it is transformers' default 0.1*ln(s) + 1.
            return float(_yarn_mscale(self.factor, self.mscale) / _yarn_mscale(self.factor, self.mscale_all_dim))
        return 1.0


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def default_inv_freq(rot_dim: int, base: float) -> torch.Tensor:
    """``1 / base^(2i / rot_dim)`` in float32 on the CPU, as Megatron Core and transformers compute it."""
    return 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim))


def band_scale_inv_freq(
    inv_freq: torch.Tensor,
    factor: float = 8.0,
    low_freq_factor: float = BAND_LOW_FREQ_FACTOR,
    high_freq_factor: float = BAND_HIGH_FREQ_FACTOR,
    original_max_positions: int = BAND_ORIGINAL_MAX_POSITIONS,
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


def yarn_inv_freq(rot_dim: int, base: float, s: RopeScaling) -> torch.Tensor:
    """YaRN's blend: interpolated (``/ factor``) frequencies below the correction range, extrapolated (unscaled)
    ones above it, a linear ramp between."""

    def correction_dim(rotations: float) -> float:
        return (rot_dim * math.log(s.original_max_positions / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rot_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    pos_freqs = base ** (torch.arange(0, rot_dim, 2).float() / rot_dim)
    extrapolated = 1.0 / pos_freqs
    interpolated = 1.0 / (s.factor * pos_freqs)
    ramp = torch.clamp((torch.arange(rot_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    return interpolated * (1 - extrapolation_weight) + extrapolated * extrapolation_weight


def dynamic_ntk_inv_freq(rot_dim: int, base: float, factor: float, original: int, seq_len: int) -> torch.Tensor:
    """Dynamic NTK: the base raised for a sequence of ``seq_len`` > ``original`` positions (float32 tensor
    arithmetic, the order transformers uses for a tensor sequence length)."""
    seq = torch.tensor(max(seq_len, original), dtype=torch.int64)
    scaled_base = base * ((factor * seq / original) - (factor - 1)) ** (rot_dim / (rot_dim - 2))
    return 1.0 / (scaled_base ** (torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim))


def longrope_inv_freq(rot_dim: int, base: float, factors: tuple[float, ...]) -> torch.Tensor:
    """LongRoPE: each frequency divided by its own factor."""
    if len(factors) != rot_dim // 2:
        raise ValueError(f"LongRoPE needs {rot_dim // 2} factors for {rot_dim} rotary channels, got {len(factors)}")
    shape = torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * base**shape)


class RotaryEmbedding(nn.Module):
    """Computes ``(cos, sin)`` tables for given position ids.

    Args:
        head_dim: channels per attention head (``kv_channels``).
        rotary_percent: fraction of each head's channels that rotate.
        rotary_base: the RoPE base (theta).
        rope_scaling: apply Llama-3 frequency scaling (shorthand for ``scaling=RopeScaling('llama3', ...)``).
        rope_scaling_factor: the Llama-3 scaling factor.
        low_freq_factor, high_freq_factor, original_max_positions: the other Llama-3 scaling constants.
        seq_len_interpolation_factor: linear scaling: divide the frequencies by this; None = off.
        scaling: a ``RopeScaling`` (yarn, dynamic, longrope or llama3); overrides ``rope_scaling``.
        interleaved: the tables repeat each frequency for an interleaved channel pair (``rotary_interleaved``).
    """

    def __init__(
        self,
        head_dim: int,
        rotary_percent: float = 1.0,
        rotary_base: float = 10000.0,
        rope_scaling: bool = False,
        rope_scaling_factor: float = 8.0,
        low_freq_factor: float = BAND_LOW_FREQ_FACTOR,
        high_freq_factor: float = BAND_HIGH_FREQ_FACTOR,
        original_max_positions: int = BAND_ORIGINAL_MAX_POSITIONS,
        seq_len_interpolation_factor: float | None = None,
        *,
        scaling: RopeScaling | None = None,
        interleaved: bool = False,
    ) -> None:
        super().__init__()
        rot_dim = int(head_dim * rotary_percent) if rotary_percent < 1.0 else head_dim
        self.rot_dim = rot_dim
        self.rotary_base = float(rotary_base)
        if scaling is None and rope_scaling:
            scaling = RopeScaling("llama3", factor=float(rope_scaling_factor), low_freq_factor=float(low_freq_factor),
                                  high_freq_factor=float(high_freq_factor),
                                  original_max_positions=int(original_max_positions))
        self.scaling = scaling
        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        self.interleaved = interleaved
        self.attention_scaling = scaling.attention_scaling() if scaling is not None else 1.0
        self._inv_freq_cache: dict[tuple[torch.device, str], torch.Tensor] = {}

    @classmethod
    def from_args(cls, args: TransformerArgs) -> "RotaryEmbedding":
        """The rotary embedding of ``TransformerArgs`` ``args`` (multi-latent attention: over its rotary part)."""
        mla = args.mla
        return cls(args.kv_channels if mla is None else mla.qk_pos_emb_head_dim, rotary_percent=args.rotary_percent, rotary_base=args.rotary_base,
                   rope_scaling=args.rope_scaling, rope_scaling_factor=args.rope_scaling_factor,
                   low_freq_factor=args.low_freq_factor, high_freq_factor=args.high_freq_factor,
                   original_max_positions=args.old_context_len,
                   seq_len_interpolation_factor=args.seq_len_interpolation_factor,
                   scaling=args.rope_scaling_method,
                   interleaved=bool(args.rotary_interleaved))

    @property
    def sequence_dependent(self) -> bool:
        """Whether the frequencies depend on the sequence length (dynamic NTK, LongRoPE)."""
        return self.scaling is not None and self.scaling.kind in ("dynamic", "longrope")

    def reencode_from(self, cached: int, total: int) -> bool:
        """Whether a decoder holding ``cached`` positions should re-encode the whole sequence when it grows to
        ``total``: LongRoPE switching from its short to its long factors (as transformers' Phi-3 does), so
        no key keeps the short factors' rotation."""
        if self.scaling is None or self.scaling.kind != "longrope":
            return False
        original = self.scaling.original_max_positions
        return cached <= original < total

    def _static_inv_freq(self, kind: str) -> torch.Tensor:
        s = self.scaling
        if kind == "llama3":
            return band_scale_inv_freq(default_inv_freq(self.rot_dim, self.rotary_base), factor=s.factor,
                                         low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor,
                                         original_max_positions=s.original_max_positions)
        if kind == "yarn":
            return yarn_inv_freq(self.rot_dim, self.rotary_base, s)
        if kind == "longrope_short":
            return longrope_inv_freq(self.rot_dim, self.rotary_base, s.short_factor)
        if kind == "longrope_long":
            return longrope_inv_freq(self.rot_dim, self.rotary_base, s.long_factor)
        return default_inv_freq(self.rot_dim, self.rotary_base)

    def _table_kind(self, seq_len: int | None) -> str:
        """Which cached table a sequence of ``seq_len`` positions uses ('dynamic' = computed for its length)."""
        s = self.scaling
        if s is None:
            return "default"
        if s.kind == "dynamic":
            return "dynamic" if seq_len is not None and seq_len > s.original_max_positions else "default"
        if s.kind == "longrope":
            long = seq_len is not None and seq_len > s.original_max_positions
            return "longrope_long" if long else "longrope_short"
        return s.kind

    def inv_freq(self, device: torch.device, seq_len: int | None = None) -> torch.Tensor:
        """Inverse frequencies ``[rot_dim // 2]`` in float32 on ``device`` for a sequence of ``seq_len``
        positions (only dynamic NTK and LongRoPE read it; None = the original length)."""
        kind = self._table_kind(seq_len)
        if kind == "dynamic":
            s = self.scaling
            inv = dynamic_ntk_inv_freq(self.rot_dim, self.rotary_base, s.factor, s.original_max_positions, seq_len)
            return self._linear(inv).to(device)
        cached = self._inv_freq_cache.get((device, kind))
        if cached is None:
            # float32 on the CPU, exactly as Megatron Core and HF compute it, so every device (and both
            # references) sees bit-identical frequencies; positions in the thousands amplify any rounding.
            cached = self._linear(self._static_inv_freq(kind)).to(device)
            self._inv_freq_cache[(device, kind)] = cached
        return cached

    def _linear(self, inv: torch.Tensor) -> torch.Tensor:
        if self.seq_len_interpolation_factor is None:
            return inv
        return inv / self.seq_len_interpolation_factor

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``position_ids [b, s]`` -> ``(cos, sin)``, each float32 ``[b, s, 1, rot_dim]`` (broadcast over heads)."""
        seq_len = None
        if self.sequence_dependent and position_ids.device.type != "meta" and position_ids.numel():
            seq_len = int(position_ids.max()) + 1
        inv = self.inv_freq(position_ids.device, seq_len)
        freqs = position_ids.float().unsqueeze(-1) * inv  # [b, s, rot_dim/2]
        if self.interleaved:
            emb = freqs.repeat_interleave(2, dim=-1).unsqueeze(2)  # [f0, f0, f1, f1, ...]
        else:
            emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(2)  # [b, s, 1, rot_dim]
        cos, sin = emb.cos(), emb.sin()
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos, sin


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` with its first half negated, so that ``x * cos + x.roll(rot_dim // 2, -1) * signed_sin(sin)``
    equals (bit for bit) the rotate_half form ``x * cos + cat(-x2, x1) * sin``: one roll instead of a
    chunk, a negation and a cat, forward and backward. Compute it once per table and pass it to
    ``apply_rotary`` for every tensor rotated with that table."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def _rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Megatron's interleaved rotation: pair ``(x[2i], x[2i+1])`` -> ``(x[2i]*c - x[2i+1]*s, x[2i+1]*c + x[2i]*s)``."""
    pairs = x.unflatten(-1, (-1, 2))
    rotated = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    return x * cos + rotated * sin


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, sin_signed: torch.Tensor | None = None,
    interleaved: bool = False,
) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` channels of every head of ``x [b, s, heads, head_dim]``.

    ``cos``/``sin`` are cast to ``x``'s dtype first, as Megatron and HF do. ``sin_signed`` is
    ``signed_sin(sin)`` when the caller has it already (e.g. shared by queries and keys); ``interleaved``
    rotates channel pairs (tables from ``RotaryEmbedding(interleaved=True)``).
    """
    rot_dim = cos.shape[-1]
    cos = cos.to(x.dtype)
    if interleaved:
        sin = sin.to(x.dtype)
        if rot_dim == x.shape[-1]:
            return _rotate_interleaved(x, cos, sin)
        return torch.cat((_rotate_interleaved(x[..., :rot_dim], cos, sin), x[..., rot_dim:]), dim=-1)
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

    def inv_freq(self, device: torch.device, seq_len: int | None = None) -> torch.Tensor:
        cached = self._scaled_cache.get(device)
        if cached is None:
            cached = super().inv_freq(device, seq_len) / self.linear_factor  # IEEE division: the same on every device
            self._scaled_cache[device] = cached
        return cached
