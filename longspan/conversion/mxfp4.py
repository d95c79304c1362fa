"""MXFP4 (OCP microscaling FP4) tensors in HF checkpoints: ``{name}_blocks`` uint8 ``[..., G, 16]``, two 4-bit
E2M1 codes per byte, low nibble first, and ``{name}_scales`` uint8 ``[..., G]``, a power-of-two exponent + 127
per 32 values. The loader decodes them for the weight-table entries marked ``mxfp4`` as transformers does."""

from __future__ import annotations

import torch

from longspan.core.errors import CheckpointError

# The 16 values of an E2M1 (MXFP4) code: sign bit, 2 exponent bits, 1 mantissa bit.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, name: str,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """MXFP4 ``blocks [..., G, 16]`` (uint8, two codes per byte, low nibble first) and ``scales [..., G]``
    (uint8 exponent + 127) as ``[..., G * 32]`` in ``dtype``: transformers' ``convert_moe_packed_tensors``
    without its final transpose. ``name`` (the HF tensor) is named in the error for mismatched shapes."""
    if tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise CheckpointError(f"MXFP4 tensor {name}: {name}_scales has shape {tuple(scales.shape)} but "
                              f"{name}_blocks {tuple(blocks.shape)} needs {tuple(blocks.shape[:-1])}")
    blocks = blocks.to(torch.uint8)
    exponents = scales.to(torch.int32) - 127
    lut = torch.tensor(FP4_VALUES, dtype=dtype)
    *prefix, groups, width = blocks.shape
    out = torch.empty(*prefix, groups, width * 2, dtype=dtype)
    out[..., 0::2] = lut[(blocks & 0x0F).to(torch.long)]
    out[..., 1::2] = lut[(blocks >> 4).to(torch.long)]
    out = torch.ldexp(out, exponents.unsqueeze(-1))
    return out.reshape(*prefix, groups * width * 2)
