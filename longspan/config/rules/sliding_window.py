"""Config rules and derivations of sliding-window attention: ``window_size`` and ``window_attn_skip_freq`` into
the per-layer windows the model reads (``layer_windows``; an encoder-decoder's ``two_sided_window`` and
``stack_window_flags``), and HF's ``layer_types`` both ways."""

from __future__ import annotations

from typing import Any

from longspan.core.errors import ConfigError, NotSupportedError

#
# Megatron's ``window_size=(left, right)``: a query at position i attends to keys j with i - left <= j <= i + right
# (flash-attention's convention; -1 = unbounded), so ``left`` counts the past tokens and the window holds
# ``left + 1`` positions with the query itself. HF's ``sliding_window=W`` (Mistral, Qwen2, Gemma: transformers'
# ``sliding_window_overlay``, ``kv_idx > q_idx - W``) holds W positions with the query itself, i.e. left = W - 1.
# longspan's per-layer ``layer_windows`` use HF's count: w = left + 1, None = full causal attention.


def _window_pair(config: Any) -> tuple[int, int] | None:
    """``window_size`` as two integers (checked to be two integers), or None when the model has no window."""
    window = getattr(config, "window_size", None)
    skip = getattr(config, "window_attn_skip_freq", None)
    if window is None:
        if skip is not None:
            raise ConfigError(
                f"model.window_attn_skip_freq={skip!r} needs model.window_size (the sliding window it alternates "
                "with full attention): set window_size=[left, 0] or unset window_attn_skip_freq"
            )
        return None
    if (not isinstance(window, (list, tuple)) or len(window) != 2
            or any(isinstance(x, bool) or not isinstance(x, int) for x in window)):
        raise ConfigError(f"model.window_size={window!r} must be two integers [left, right] (or None)")
    return int(window[0]), int(window[1])


def _window_left(config: Any) -> int | None:
    """The checked ``window_size`` left extent, or None when the model has no window."""
    window = _window_pair(config)
    if window is None:
        return None
    left, right = window
    if right != 0:
        raise NotSupportedError(
            f"model.window_size={list(window)!r}: right={right} is not supported: a causal language model "
            "attends to no later token, use [left, 0]"
        )
    if left < -1:
        raise ConfigError(
            f"model.window_size={list(window)!r}: left={left} must be >= 0 (past tokens each token sees) or -1 "
            "(unbounded: full attention)"
        )
    return None if left == -1 else left


def window_layer_flags(skip_freq: Any, num_layers: int) -> list[bool]:
    """Which layers use the sliding window (Megatron's ``window_attn_skip_freq``): None -> every layer; an int N
    -> all but every N-th layer (layers with ``(i + 1) % N == 0``, 0-based i, are full attention); a list -> its
    0/1 entry per layer (1 = sliding window)."""
    if skip_freq is None:
        return [True] * num_layers
    if isinstance(skip_freq, bool) or not isinstance(skip_freq, (int, list, tuple)):
        raise ConfigError(
            f"model.window_attn_skip_freq={skip_freq!r} must be a positive int or a 0/1 list per layer (or None)"
        )
    if isinstance(skip_freq, int):
        if skip_freq < 1:
            raise ConfigError(f"model.window_attn_skip_freq={skip_freq} must be >= 1 (or a 0/1 list per layer)")
        return [(i + 1) % skip_freq != 0 for i in range(num_layers)]
    if len(skip_freq) != num_layers or any(x not in (0, 1) for x in skip_freq):
        raise ConfigError(
            f"model.window_attn_skip_freq={list(skip_freq)!r} must hold one 0/1 entry per layer ({num_layers} "
            "layers; 1 = sliding window, 0 = full attention)"
        )
    return [bool(x) for x in skip_freq]


def layer_windows(config: Any) -> list[int | None]:
    """Each layer's attention window (checked): the number of positions a token attends to, itself included
    (HF's ``sliding_window``; Megatron's left extent + 1), or None for full causal attention."""
    left = _window_left(config)
    flags = window_layer_flags(getattr(config, "window_attn_skip_freq", None), config.num_layers)
    if left is None:
        return [None] * config.num_layers
    return [left + 1 if sliding else None for sliding in flags]


def two_sided_window(config: Any) -> tuple[int, int] | None:
    """An encoder-decoder's checked ``window_size`` (T5): ``(left, right)``, each >= 0 or -1 (that side
    unbounded), or None when there is no window (unset, or ``[-1, -1]``: Transformer Engine's "no window").
    Unlike a causal language model's, ``right`` counts here: the bidirectional encoder attends to ``right``
    later tokens (``longspan.models.t5``)."""
    window = _window_pair(config)
    if window is None:
        return None
    left, right = window
    if left < -1 or right < -1:
        raise ConfigError(
            f"model.window_size={list(window)!r}: each extent must be >= 0 (tokens seen on that side) or -1 "
            "(unbounded)"
        )
    return None if window == (-1, -1) else window


def stack_window_flags(config: Any, stack_layers: list[int]) -> list[list[bool]]:
    """Which layers of each stack of an encoder-decoder (``stack_layers``: each stack's depth) are sliding-window
    layers. Megatron's T5 numbers each stack's layers from 1 on its own, so ``window_attn_skip_freq=N`` makes
    the N-th, 2N-th, ... layer of each stack full attention, and a 0/1 list is read by each stack from its
    start: it needs one entry per layer of the deeper stack."""
    deepest = max(stack_layers)
    if two_sided_window(config) is None:
        return [[False] * n for n in stack_layers]
    flags = window_layer_flags(getattr(config, "window_attn_skip_freq", None), deepest)
    return [flags[:n] for n in stack_layers]


def window_pattern_from_layer_types(layer_types: list[str]) -> list[int]:
    """HF ``layer_types`` (``"sliding_attention"`` / ``"full_attention"`` per layer) as the 0/1 list of
    ``window_attn_skip_freq`` (1 = sliding window)."""
    pattern = []
    for i, kind in enumerate(layer_types):
        if kind not in ("sliding_attention", "full_attention"):
            raise NotSupportedError(
                f"config.json layer_types[{i}]={kind!r} is not supported: use 'sliding_attention' or 'full_attention'"
            )
        pattern.append(1 if kind == "sliding_attention" else 0)
    return pattern


def layer_types_from_windows(windows: list[int | None]) -> list[str]:
    """The inverse: HF ``layer_types`` of per-layer windows."""
    return ["full_attention" if w is None else "sliding_attention" for w in windows]
