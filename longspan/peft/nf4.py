"""NF4: 4-bit NormalFloat storage of a frozen weight (QLoRA, Dettmers et al. 2023), in plain PyTorch.

Layout of a quantized ``[out, in]`` weight:

- each row is cut into blocks of ``block_size`` (64) consecutive input columns; a row whose length is not a
  multiple of the block size is padded with zeros (which leave the block's absmax unchanged) and the padding
  is dropped on dequantization. Blocks never cross rows, so a tensor-parallel shard whose columns are a
  multiple of the block size (or any row shard) quantizes to exactly the blocks the whole weight has;
- per block one float32 ``absmax`` (the largest magnitude in it): the scale. Scales are NOT double-quantized:
  float32 scales cost 32 / 64 = 0.5 bit per weight (4.5 bits in all, 0.5625 byte) instead of ~0.127 bit with
  QLoRA's 8-bit second-level quantization; kept exact and simple, at 0.37 bit/param more;
- each weight divided by its block's absmax lies in [-1, 1] and is stored as the index (0..15) of the nearest of
  the 16 NF4 code values (``NF4_CODES``: quantiles of a standard normal, rescaled to [-1, 1], with an exact 0),
  two indices per ``uint8`` (the even column in the high nibble).

Dequantization is ``NF4_CODES[index] * absmax``, so every weight is within half the gap between its two
neighbouring codes times its block's absmax: ``|w - dequant(w)| <= NF4_MAX_HALF_GAP * absmax`` with
``NF4_MAX_HALF_GAP = (1 - 0.6961928) / 2 ≈ 0.1519`` (the widest gap is between the two most negative codes,
-1 and -0.6962; on the positive side it is 1 - 0.7230).

``NF4LinearFunction`` computes ``x Wᵀ`` from the packed weight: the weight is dequantized in the compute dtype
in forward and again in backward (nothing but the 4-bit codes and scales is kept between the two), and only
the input's gradient is returned: the base is frozen.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

# The 16 NF4 values of QLoRA's paper / bitsandbytes (appendix E): 8 positive and 7 negative normal quantiles,
# normalized to [-1, 1], and an exact zero.
NF4_CODES = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)
NF4_MAX_HALF_GAP = max(b - a for a, b in zip(NF4_CODES, NF4_CODES[1:])) / 2
DEFAULT_BLOCK_SIZE = 64
#: bytes of storage per quantized weight: 4-bit code + a float32 absmax per block of 64
NF4_BYTES_PER_PARAM = 0.5 + 4.0 / DEFAULT_BLOCK_SIZE


def _codes(device: torch.device) -> torch.Tensor:
    return torch.tensor(NF4_CODES, dtype=torch.float32, device=device)


def quantize_nf4(weight: torch.Tensor, block_size: int = DEFAULT_BLOCK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed codes ``uint8 [out, padded_in / 2]``, absmax ``float32 [out, blocks]``) of a 2-D ``weight``."""
    if weight.dim() != 2:
        raise ValueError(f"quantize_nf4 takes a 2-D weight, got shape {tuple(weight.shape)}")
    if block_size < 2 or block_size % 2:
        raise ValueError(f"NF4 block size must be an even number >= 2, got {block_size}")
    rows, cols = weight.shape
    blocks = -(-cols // block_size)
    w = weight.detach().to(torch.float32)
    if blocks * block_size != cols:
        w = F.pad(w, (0, blocks * block_size - cols))
    w = w.reshape(rows, blocks, block_size)
    absmax = w.abs().amax(dim=-1)
    normalized = w / absmax.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)
    codes = _codes(w.device)
    midpoints = (codes[1:] + codes[:-1]) / 2
    index = torch.bucketize(normalized, midpoints).to(torch.uint8).reshape(rows, blocks * block_size)
    packed = (index[:, 0::2] << 4) | index[:, 1::2]
    return packed.contiguous(), absmax.contiguous()


def dequantize_nf4(packed: torch.Tensor, absmax: torch.Tensor, columns: int,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The ``[out, columns]`` weight in ``dtype`` from ``quantize_nf4``'s output (computed in float32)."""
    rows, blocks = absmax.shape
    index = torch.stack((packed >> 4, packed & 0x0F), dim=-1).reshape(rows, blocks, -1).long()
    values = _codes(packed.device)[index] * absmax.unsqueeze(-1)
    return values.reshape(rows, -1)[:, :columns].to(dtype)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype


class NF4LinearFunction(torch.autograd.Function):
    """``x Wᵀ`` with ``W`` stored in NF4; the gradient flows to ``x`` only (``W`` is frozen)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor,  # type: ignore[override]
                columns: int) -> torch.Tensor:
        dtype = _compute_dtype(x)
        weight = dequantize_nf4(packed, absmax, columns, dtype)
        ctx.save_for_backward(packed, absmax)
        ctx.columns, ctx.dtype, ctx.input_dtype = columns, dtype, x.dtype
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x.to(dtype), weight)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        packed, absmax = ctx.saved_tensors
        weight = dequantize_nf4(packed, absmax, ctx.columns, ctx.dtype)  # recomputed, not kept from forward
        grad_input = grad_output.to(ctx.dtype) @ weight
        return grad_input.to(ctx.input_dtype), None, None, None


def nf4_linear(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, columns: int) -> torch.Tensor:
    """``F.linear(x, dequantize_nf4(packed, absmax, columns))`` without keeping the dequantized weight."""
    return NF4LinearFunction.apply(x, packed, absmax, columns)
