"""Config rules of sliding-window attention: ``window_size`` (a causal model's ``[left, 0]``, an
encoder-decoder's two-sided window) and ``window_attn_skip_freq`` (which layers alternate with full attention).
Which layer gets which window is the models' (``longspan.models.layer_pattern``), after these checks."""

from __future__ import annotations

from typing import Any

from longspan.core.errors import ConfigError, NotSupportedError


def _window_pair(config: Any) -> tuple[int, int] | None:
    """``window_size`` as two integers (checked to be two integers), or None when the model has no window."""
    window, skip = config.window_size, config.window_attn_skip_freq
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


def causal_window_left(config: Any) -> int | None:
    """A causal model's checked ``window_size`` left extent (past tokens each token sees), or None when the
    model has no window (unset, or left -1: unbounded)."""
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


def check_window_skip_freq(skip_freq: Any, num_layers: int) -> None:
    """``window_attn_skip_freq``: None (every layer windowed), a positive int N (every N-th layer full attention)
    or a 0/1 list with one entry per layer (1 = sliding window)."""
    if skip_freq is None:
        return
    if isinstance(skip_freq, bool) or not isinstance(skip_freq, (int, list, tuple)):
        raise ConfigError(
            f"model.window_attn_skip_freq={skip_freq!r} must be a positive int or a 0/1 list per layer (or None)"
        )
    if isinstance(skip_freq, int):
        if skip_freq < 1:
            raise ConfigError(f"model.window_attn_skip_freq={skip_freq} must be >= 1 (or a 0/1 list per layer)")
        return
    if len(skip_freq) != num_layers or any(x not in (0, 1) for x in skip_freq):
        raise ConfigError(
            f"model.window_attn_skip_freq={list(skip_freq)!r} must hold one 0/1 entry per layer ({num_layers} "
            "layers; 1 = sliding window, 0 = full attention)"
        )


def check_causal_window(config: Any) -> None:
    """A causal model's window fields (GPT, Mamba's attention layers): ``window_size=[left, 0]`` and its
    ``window_attn_skip_freq`` over ``num_layers``."""
    causal_window_left(config)
    check_window_skip_freq(config.window_attn_skip_freq, config.num_layers)


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


def check_stack_windows(config: Any, stack_layers: list[int]) -> None:
    """An encoder-decoder's window fields: the two-sided ``window_size`` and, when there is a window, its
    ``window_attn_skip_freq`` read by each stack from its start (one entry per layer of the deeper stack)."""
    if two_sided_window(config) is not None:
        check_window_skip_freq(config.window_attn_skip_freq, max(stack_layers))
