"""Which layer of a model's stack is what: the per-layer sliding windows (Megatron's ``window_size`` and
``window_attn_skip_freq``, HF's ``layer_types``), the gated DeltaNet (linear attention) layers
(``linear_attention_freq``) and the MoE layers (``moe_layer_freq``). The fields' rules
(valid values, one line naming the field) live in ``longspan.config.rules.sliding_window`` / ``.moe``; each
function here checks its fields with them before laying out the layers.

Megatron's ``window_size=(left, right)``: a query at position i attends to keys j with i - left <= j <= i + right
(flash-attention's convention; -1 = unbounded), so ``left`` counts the past tokens and the window holds
``left + 1`` positions with the query itself. HF's ``sliding_window=W`` (Mistral, Qwen2, Gemma: transformers'
``sliding_window_overlay``, ``kv_idx > q_idx - W``) holds W positions with the query itself, i.e. left = W - 1.
longspan's per-layer ``layer_windows`` use HF's count: w = left + 1, None = full causal attention.
"""

from __future__ import annotations

from typing import Any

from longspan.config.rules.linear_attention import check_linear_attention_freq
from longspan.config.rules.moe import check_moe_layer_freq
from longspan.config.rules.sliding_window import (
    causal_window_left,
    check_window_skip_freq,
    two_sided_window,
)
from longspan.core.errors import NotSupportedError


def window_layer_flags(skip_freq: Any, num_layers: int) -> list[bool]:
    """Which layers use the sliding window (Megatron's ``window_attn_skip_freq``): None -> every layer; an int N
    -> all but every N-th layer (layers with ``(i + 1) % N == 0``, 0-based i, are full attention); a list -> its
    0/1 entry per layer (1 = sliding window)."""
    check_window_skip_freq(skip_freq, num_layers)
    if skip_freq is None:
        return [True] * num_layers
    if isinstance(skip_freq, int):
        return [(i + 1) % skip_freq != 0 for i in range(num_layers)]
    return [bool(x) for x in skip_freq]


def layer_windows(config: Any) -> list[int | None]:
    """Each layer's attention window (checked): the number of positions a token attends to, itself included
    (HF's ``sliding_window``; Megatron's left extent + 1), or None for full causal attention."""
    left = causal_window_left(config)
    flags = window_layer_flags(config.window_attn_skip_freq, config.num_layers)
    if left is None:
        return [None] * config.num_layers
    return [left + 1 if sliding else None for sliding in flags]


def stack_window_flags(config: Any, stack_layers: list[int]) -> list[list[bool]]:
    """Which layers of each stack of an encoder-decoder (``stack_layers``: each stack's depth) are sliding-window
    layers. Megatron's T5 numbers each stack's layers from 1 on its own, so ``window_attn_skip_freq=N`` makes
    the N-th, 2N-th, ... layer of each stack full attention, and a 0/1 list is read by each stack from its
    start: it needs one entry per layer of the deeper stack."""
    if two_sided_window(config) is None:
        return [[False] * n for n in stack_layers]
    flags = window_layer_flags(config.window_attn_skip_freq, max(stack_layers))
    return [flags[:n] for n in stack_layers]


def _pattern_from_layer_types(layer_types: list[str], marked: str) -> list[int]:
    """HF ``layer_types`` as a 0/1 list: 1 for ``marked`` layers, 0 for ``"full_attention"``; any other kind is
    refused in one line."""
    pattern = []
    for i, kind in enumerate(layer_types):
        if kind not in (marked, "full_attention"):
            raise NotSupportedError(
                f"config.json layer_types[{i}]={kind!r} is not supported: use '{marked}' or 'full_attention'"
            )
        pattern.append(1 if kind == marked else 0)
    return pattern


def window_pattern_from_layer_types(layer_types: list[str]) -> list[int]:
    """HF ``layer_types`` (``"sliding_attention"`` / ``"full_attention"`` per layer) as the 0/1 list of
    ``window_attn_skip_freq`` (1 = sliding window)."""
    return _pattern_from_layer_types(layer_types, "sliding_attention")


def layer_types_from_windows(windows: list[int | None]) -> list[str]:
    """The inverse: HF ``layer_types`` of per-layer windows."""
    return ["full_attention" if w is None else "sliding_attention" for w in windows]


def moe_layer_flags(freq: Any, num_layers: int) -> list[bool]:
    """Which layers are MoE layers: an int ``n`` makes every n-th layer (0, n, 2n, ...) MoE, a list is a 0/1
    pattern per layer (Megatron's ``moe_layer_freq``)."""
    check_moe_layer_freq(freq, num_layers)
    if isinstance(freq, int):
        return [i % freq == 0 for i in range(num_layers)]
    return [bool(x) for x in freq]


def linear_attention_layer_flags(freq: Any, num_layers: int) -> list[bool]:
    """Which layers are gated DeltaNet (linear attention) layers (Megatron's ``linear_attention_freq``): an int N
    -> all but every N-th layer (layers with ``(i + 1) % N == 0``, 0-based i, are full attention); a list -> its
    0/1 entry per layer (1 = linear attention)."""
    check_linear_attention_freq(freq, num_layers)
    if isinstance(freq, int):
        return [(i + 1) % freq != 0 for i in range(num_layers)]
    return [bool(x) for x in freq]


def linear_attention_pattern_from_layer_types(layer_types: list[str]) -> list[int]:
    """HF ``layer_types`` (``"linear_attention"`` / ``"full_attention"`` per layer) as the 0/1 list of
    ``linear_attention_freq`` (1 = linear attention)."""
    return _pattern_from_layer_types(layer_types, "linear_attention")


def layer_types_from_linear_attention(flags: list[bool]) -> list[str]:
    """The inverse: HF ``layer_types`` of per-layer linear-attention flags."""
    return ["linear_attention" if linear else "full_attention" for linear in flags]
