"""A ``TwoSidedMask`` (a caller's mask that lets some queries see later keys: Gemma 3's image tokens) through the
decoder's per-layer masks: full-attention layers get the caller's mask as it is; sliding-window layers add only the
window's far edge, on sequences long enough for the block-local path too."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from longspan.models.sliding_window import MIN_CHUNK, TwoSidedMask, WindowedMask, windowed_attention
from longspan.models.transformer import layer_masks


def _two_sided(s: int, block: range) -> torch.Tensor:
    """Causal, except that the positions of ``block`` see each other both ways (True = masked)."""
    masked = torch.ones(s, s, dtype=torch.bool).triu(1)
    masked[block.start:block.stop, block.start:block.stop] = False
    return masked[None, None]


@pytest.mark.parametrize("s", [12, MIN_CHUNK + 40])
def test_sliding_window_keeps_the_callers_later_keys(s):
    # a block longer than the window; on the long sequence it crosses the block-local path's chunk boundary
    window, block = 4, range(3, 9) if s < MIN_CHUNK else range(MIN_CHUNK - 4, MIN_CHUNK + 2)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, s, 8) for _ in range(3))
    base = _two_sided(s, block)
    ours = windowed_attention(q, k, v, WindowedMask(window, base, causal=False))
    distance = torch.arange(s)[:, None] - torch.arange(s)[None, :]
    keep = ~base & (distance < window)  # HF's Gemma 3: AND(window, OR(causal, block))
    assert torch.allclose(ours, F.scaled_dot_product_attention(q, k, v, attn_mask=keep), atol=1e-6)
    # The block's first query sees the block's later keys; a causal window would not.
    causal = windowed_attention(q, k, v, WindowedMask(window, base))
    assert not torch.allclose(ours[:, :, block.start], causal[:, :, block.start], atol=1e-4)


def test_layer_masks_unwrap_a_two_sided_mask():
    base = _two_sided(6, range(1, 4))

    class Layer(torch.nn.Module):
        def __init__(self, window):
            super().__init__()
            self.self_attention = torch.nn.Module()
            self.self_attention.window = window

    full, sliding = layer_masks([Layer(None), Layer(3)], TwoSidedMask(base))
    assert full is base
    assert isinstance(sliding, WindowedMask) and sliding.base is base and not sliding.causal
    with pytest.raises(ValueError, match="needs the caller's mask"):
        WindowedMask(3, None, causal=False)
