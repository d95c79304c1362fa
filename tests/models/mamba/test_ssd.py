"""The chunked SSD scan equals the sequential recurrence, forward and backward."""

from __future__ import annotations

import pytest
import torch

from longspan.models.ssd import segment_sums, ssd_chunked_scan, ssd_sequential_scan


def _inputs(batch: int, length: int, heads: int = 4, head_dim: int = 3, groups: int = 2, state: int = 5,
            seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, length, heads, head_dim, generator=g)
    dt = torch.nn.functional.softplus(torch.randn(batch, length, heads, generator=g) - 1.0)
    A = -torch.empty(heads).uniform_(1.0, 16.0, generator=g)
    B = torch.randn(batch, length, groups, state, generator=g)
    C = torch.randn(batch, length, groups, state, generator=g)
    return [t.requires_grad_() for t in (x, dt, A, B, C)]


@pytest.mark.parametrize("length", [1, 7, 16, 33])
@pytest.mark.parametrize("chunk", [1, 3, 8, 16, 64])
def test_chunked_scan_equals_sequential_forward_and_backward(length: int, chunk: int) -> None:
    inputs = _inputs(2, length)
    y_ref, s_ref = ssd_sequential_scan(*inputs)
    y, s = ssd_chunked_scan(*inputs, chunk_size=chunk)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(s, s_ref, rtol=0, atol=1e-5)
    weights = torch.randn_like(y_ref)  # a random projection: every output element gets its own gradient
    grads_ref = torch.autograd.grad((y_ref * weights).sum() + s_ref.sum(), inputs)
    grads = torch.autograd.grad((y * weights).sum() + s.sum(), inputs)
    for name, got, want in zip("x dt A B C".split(), grads, grads_ref):
        scale = max(1.0, want.abs().max().item())
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * scale, msg=f"grad {name}")


def test_chunked_scan_continues_from_an_initial_state() -> None:
    inputs = _inputs(1, 20)
    y_all, s_all = ssd_sequential_scan(*inputs)
    first = [t[:, :9] if t.dim() > 1 else t for t in inputs]
    rest = [t[:, 9:] if t.dim() > 1 else t for t in inputs]
    y1, s1 = ssd_chunked_scan(*first, chunk_size=4)
    y2, s2 = ssd_chunked_scan(*rest, chunk_size=4, initial_state=s1)
    torch.testing.assert_close(torch.cat([y1, y2], 1), y_all, rtol=0, atol=1e-5)
    torch.testing.assert_close(s2, s_all, rtol=0, atol=1e-5)


def test_segment_sums() -> None:
    a = torch.tensor([1.0, 2.0, 3.0])
    want = torch.tensor([[0.0, -torch.inf, -torch.inf], [2.0, 0.0, -torch.inf], [5.0, 3.0, 0.0]])
    torch.testing.assert_close(segment_sums(a), want)


def test_bad_chunk_size_is_rejected() -> None:
    with pytest.raises(ValueError, match="chunk_size"):
        ssd_chunked_scan(*_inputs(1, 4), chunk_size=0)
