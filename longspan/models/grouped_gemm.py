"""One matrix product for all experts: ``torch._grouped_mm`` behind a custom op, and when it can serve.

``grouped_linear(x, weight, offsets)`` computes, for rows ``[offsets[e-1], offsets[e])`` of ``x [N, in]``, the
product with expert e's ``weight[e] [out, in]`` (``x @ weight[e].T``), for every expert at once, forward and
backward (input gradient: another grouped product with the weights; weight gradient: the 2-D × 2-D grouped
form, one ``[out, in]`` block per expert). Offsets are int32 on the rows' device, cumulative, so the token
counts never reach the host. Rows past ``offsets[-1]`` (padding after token dropping) come out as zeros: the
kernel leaves them unwritten.

Why a custom op around ``torch._grouped_mm`` rather than the op itself: its fake-tensor rule (torch 2.13)
accepts bfloat16 only, so ``torch.compile`` could not trace the float32 CPU kernel, and its own backward
needs a contiguous output gradient (a ``.sum()`` loss sends a stride-0 one). The custom op is opaque to
compile (no recompiles for new token counts) and makes the gradient contiguous.

``grouped_gemm_unsupported(dtype, device, dims)`` says why the kernel cannot serve (``None`` when it can):
float32/bfloat16/float16 on CPU, bfloat16 on CUDA devices of compute capability 8.0 or more, and matrix rows
of a multiple of 16 bytes (the kernel's alignment).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

_CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def grouped_gemm_unsupported(dtype: torch.dtype, device: torch.device, dims: Sequence[int]) -> Optional[str]:
    """Why ``torch._grouped_mm`` cannot run expert matrices of ``dtype`` on ``device`` whose inner sizes are
    ``dims`` (hidden size, expert width); None when it can."""
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    if device.type == "cpu":
        if dtype not in _CPU_DTYPES:
            return f"the CPU kernel takes float32, bfloat16 or float16, not {dtype}"
    elif device.type == "cuda":
        if dtype != torch.bfloat16:
            return f"the CUDA kernel takes bfloat16, not {dtype}"
        if torch.cuda.get_device_capability(device) < (8, 0):
            return f"the CUDA kernel needs compute capability 8.0 or more ({torch.cuda.get_device_name(device)})"
    else:
        return f"no grouped kernel on {device.type}"
    alignment = 16 // torch.empty((), dtype=dtype).element_size()
    odd = [d for d in dims if d % alignment]
    if odd:
        return f"matrix sizes {odd} are not multiples of {alignment} ({dtype} rows must span multiples of 16 bytes)"
    return None


def _valid_rows(out: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``out [N, k]`` with the rows past ``offsets[-1]`` set to zero (the kernel leaves them unwritten)."""
    if out.shape[0] == 0 or offsets.numel() == 0:
        return out
    if out.device.type == "cpu":  # the CPU kernel reads every offset itself; zero only the tail
        end = int(offsets[-1])
        if end < out.shape[0]:
            out[end:].zero_()
        return out
    rows = torch.arange(out.shape[0], device=out.device, dtype=offsets.dtype)
    return out.masked_fill_((rows >= offsets[-1]).unsqueeze(1), 0)


@torch.library.custom_op("longspan::grouped_mm", mutates_args=())
def grouped_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(a, b, offs=offsets)`` for ``a [N, k]`` and either ``b [E, k, n]`` (result ``[N, n]``,
    padding rows zero) or ``b [N, n]`` (result ``[E, k, n]``, the per-group ``a_e @ b_e``). Not differentiable:
    the building block of ``grouped_linear``'s forward and backward."""
    if b.dim() == 3:
        if a.shape[0] == 0:
            return a.new_zeros(0, b.shape[-1])
        return _valid_rows(torch._grouped_mm(a, b, offs=offsets), offsets)
    if a.shape[1] == 0:  # no rows to sum over: every group's product is zero
        return a.new_zeros(offsets.numel(), a.shape[0], b.shape[1])
    return torch._grouped_mm(a, b, offs=offsets)


@grouped_mm.register_fake
def _grouped_mm_fake(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    if b.dim() == 3:
        return a.new_empty(a.shape[0], b.shape[-1])
    return a.new_empty(offsets.shape[0], a.shape[0], b.shape[1])


@torch.library.custom_op("longspan::grouped_linear", mutates_args=())
def _grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return grouped_mm(x, weight.transpose(-2, -1), offsets)


@_grouped_linear.register_fake
def _grouped_linear_fake(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[1])


def _setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], None]:
    x, weight, offsets = ctx.saved_tensors
    grad = grad.contiguous()
    grad_x = grouped_mm(grad, weight, offsets) if ctx.needs_input_grad[0] else None
    # [E, out, in] directly in the weight's layout (no transposed copy when the gradient accumulates)
    grad_w = grouped_mm(grad.t(), x, offsets) if ctx.needs_input_grad[1] else None
    return grad_x, grad_w, None


_grouped_linear.register_autograd(_backward, setup_context=_setup_context)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``x [N, in]`` rows grouped by expert times each expert's ``weight [E, out, in]`` transposed: ``[N, out]``.
    ``offsets`` (int32, ``[E]``) ends each expert's rows; rows past the last offset give zeros."""
    return _grouped_linear(x.contiguous(), weight, offsets)


def rows_expert(offsets: torch.Tensor, num_rows: int) -> torch.Tensor:
    """The expert index of each of ``num_rows`` rows grouped by ``offsets`` (``len(offsets)`` for padding rows
    past the last offset), computed on the device."""
    rows = torch.arange(num_rows, device=offsets.device, dtype=offsets.dtype)
    return torch.searchsorted(offsets, rows, right=True)
