"""Mistral (``MistralForCausalLM``) and Ministral (``MinistralForCausalLM``): the standard decoder with a
sliding window, as config.json and weights.

Mistral windows every layer (HF's ``sliding_window``: the positions a token attends to, itself included, is
Megatron's ``window_size=[W - 1, 0]``); Ministral windows the layers ``layer_types`` marks.
"""

from __future__ import annotations

from typing import Any

from longspan.conversion.config_fields import required, window_fields, window_hf
from longspan.conversion.decoder_fields import NO_WINDOW, decoder_hf, decoder_provider, provider_view
from longspan.conversion.families import Family
from longspan.conversion.mapping import DECODER
from longspan.core.errors import NotSupportedError


def window_size_from_hf(sliding_window: Any, key: str = "sliding_window") -> list[int] | None:
    """HF's ``sliding_window`` (positions a token attends to, itself included) as Megatron's ``window_size``
    ``[W - 1, 0]``; None (or 0) = full attention."""
    if sliding_window is None or sliding_window == 0:
        return None
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
        raise NotSupportedError(f"config.json {key}={sliding_window!r} must be a positive integer or null")
    return [sliding_window - 1, 0]


def hf_sliding_window(p: Any, family: str) -> int | None:
    """A provider's window as HF's ``sliding_window`` of a family whose every layer uses it."""
    window = p.window_size
    if window is None or window[0] == -1:
        return None
    if p.window_attn_skip_freq not in (None, [1] * p.num_layers):
        raise NotSupportedError(
            f"window_attn_skip_freq={p.window_attn_skip_freq!r}: {family} applies its sliding window to every "
            "layer; a model with full-attention layers between has no such HF equivalent"
        )
    return int(window[0]) + 1


def mistral_provider(cfg: dict[str, Any]) -> dict[str, Any]:
    """Provider keyword arguments of a Mistral config.json."""
    window = window_size_from_hf(cfg.get("sliding_window"))
    return dict(decoder_provider(dict(cfg, sliding_window=None), family="Mistral"), window_size=window)


def mistral_hf(p: Any) -> dict[str, Any]:
    """A Mistral config.json body for provider ``p``."""
    out = decoder_hf(provider_view(p, **NO_WINDOW), family="Mistral")
    for key in ("attention_bias", "mlp_bias"):
        if out.pop(key):
            raise NotSupportedError("Mistral has no linear biases: export it as an architecture that has them")
    return dict(out, sliding_window=hf_sliding_window(p, "Mistral"))


def ministral_provider(cfg: dict[str, Any]) -> dict[str, Any]:
    """Ministral (8B): Mistral's layout with a sliding window on the layers ``layer_types`` marks (default:
    every layer when sliding_window is set)."""
    out = decoder_provider(dict(cfg, sliding_window=None), family="Ministral")
    return dict(out, **window_fields(cfg.get("sliding_window"), cfg.get("layer_types"),
                                     required(cfg, "num_hidden_layers")))


def ministral_hf(p: Any) -> dict[str, Any]:
    """A Ministral config.json body for provider ``p``."""
    out = decoder_hf(provider_view(p, **NO_WINDOW), family="Ministral")
    for key in ("attention_bias", "mlp_bias"):
        if out.pop(key):
            raise NotSupportedError("Ministral has no linear biases: export it as an architecture that has them")
    window, layer_types = window_hf(p)
    return dict(out, sliding_window=window, layer_types=layer_types)


MISTRAL = Family("mistral", "MistralForCausalLM", "mistral", DECODER, mistral_provider, mistral_hf)
MINISTRAL = Family("ministral", "MinistralForCausalLM", "ministral", DECODER, ministral_provider, ministral_hf)
