"""The standard decoder's config.json translation (RMSNorm, RoPE, gated MLP, grouped-query attention), which
most families build on: the field table ``DECODER_FIELDS`` and the checks a table cannot say.

``family`` arguments are the display name used in errors ("Llama", "Qwen3", ...), given by the caller.
"""

from __future__ import annotations

import copy
from typing import Any, TypeVar

from longspan.conversion.config_fields import (
    HF_ACTIVATIONS,
    dtype_fields,
    hf_activation,
    rope_fields,
    rope_hf,
    vocab_divisor,
)
from longspan.conversion.hf_fields import HFField, export_fields, import_fields, override, with_default
from longspan.core.errors import NotSupportedError

P = TypeVar("P")


def _kv_channels(p: Any) -> int:
    return p.kv_channels or p.hidden_size // p.num_attention_heads


DECODER_FIELDS: tuple[HFField, ...] = (
    HFField("num_hidden_layers", "num_layers"),
    HFField("hidden_size", "hidden_size"),
    HFField("intermediate_size", "ffn_hidden_size"),
    HFField("num_attention_heads", "num_attention_heads"),
    HFField("num_key_value_heads", "num_query_groups", default=lambda cfg: cfg["num_attention_heads"],
            falsy_default=True, from_provider=lambda p: p.num_query_groups or p.num_attention_heads),
    HFField("head_dim", "kv_channels", falsy_default=True,
            default=lambda cfg: _required(cfg, "hidden_size") // cfg["num_attention_heads"],
            from_provider=_kv_channels),
    HFField("max_position_embeddings", "seq_length", default=4096),
    HFField("vocab_size", "vocab_size"),
    HFField("rms_norm_eps", "layernorm_epsilon", default=1e-6, to_ours=float),
    HFField("tie_word_embeddings", "share_embeddings_and_output_weights", default=False, to_ours=bool),
    HFField("attention_dropout", "attention_dropout", default=0.0, to_ours=float),
    HFField("initializer_range", "init_method_std", default=0.02, to_ours=float),
)
"""config.json keys <-> provider fields of the standard decoder (import order = the provider's keyword order)."""


def _required(cfg: dict[str, Any], key: str) -> Any:
    return import_fields((HFField(key, key),), cfg)[key]


def decoder_provider(cfg: dict[str, Any], family: str, eps_default: float = 1e-6) -> dict[str, Any]:
    """Provider keyword arguments of a standard decoder's config.json (no sliding window: the families that
    have one translate it themselves)."""
    act = cfg.get("hidden_act", "silu")
    if act not in HF_ACTIVATIONS:
        raise NotSupportedError(f"config.json hidden_act={act!r} is not supported: use one of {', '.join(HF_ACTIVATIONS)}")
    for key in ("sliding_window", "use_sliding_window"):
        if cfg.get(key) and (key == "use_sliding_window" or cfg.get("use_sliding_window", True)):
            raise NotSupportedError(
                f"config.json {key}={cfg[key]!r}: sliding-window attention is not supported by longspan for "
                f"{family} models; set it to null to convert with full attention"
            )
    attention_bias = bool(cfg.get("attention_bias", False))
    mlp_bias = bool(cfg.get("mlp_bias", False))
    if attention_bias and not mlp_bias:
        raise NotSupportedError(
            "config.json attention_bias=true with mlp_bias=false (a bias on o_proj but not the MLP) is not supported"
        )
    out = import_fields(with_default(DECODER_FIELDS, "rms_norm_eps", eps_default), cfg)
    vocab = out["vocab_size"]
    out.update(
        make_vocab_size_divisible_by=vocab_divisor(vocab),
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=HF_ACTIVATIONS[act],
        add_bias_linear=attention_bias and mlp_bias,
        add_qkv_bias=attention_bias,
        hidden_dropout=0.0,
    )
    out.update(rope_fields(cfg))
    out.update(dtype_fields(cfg))
    return _ordered(out)


# The keyword order the translations have always produced (a provider's YAML and repr follow it).
_ORDER = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
          "seq_length", "vocab_size", "make_vocab_size_divisible_by", "normalization", "layernorm_epsilon",
          "gated_linear_unit", "activation_func", "add_bias_linear", "add_qkv_bias",
          "share_embeddings_and_output_weights", "attention_dropout", "hidden_dropout", "init_method_std")


def _ordered(out: dict[str, Any]) -> dict[str, Any]:
    return {**{k: out[k] for k in _ORDER if k in out}, **{k: v for k, v in out.items() if k not in _ORDER}}


def activation_func(cfg: dict[str, Any], key: str = "hidden_act", default: str = "silu") -> Any:
    """The activation function config.json's ``key`` names (``default`` when absent or null)."""
    act = cfg.get(key) or default
    if act not in HF_ACTIVATIONS:
        raise NotSupportedError(f"config.json {key}={act!r} is not supported: use one of {', '.join(HF_ACTIVATIONS)}")
    return HF_ACTIVATIONS[act]


_SHAPE_FIELDS = override(DECODER_FIELDS, drop=("tie_word_embeddings",))


def decoder_shape(cfg: dict[str, Any], eps_default: float) -> dict[str, Any]:
    """The sizes, vocabulary, dtype and fixed choices (RMSNorm, gated MLP, no linear biases) of a decoder's
    config.json, for families that choose their activation, tied embeddings, RoPE and norm placement
    themselves."""
    if cfg.get("attention_bias"):
        raise NotSupportedError(
            f"config.json attention_bias=true is not supported for {cfg.get('model_type')}: longspan implements "
            "these models without linear biases (attention_bias=false)"
        )
    out = import_fields(with_default(_SHAPE_FIELDS, "rms_norm_eps", eps_default), cfg)
    out.update(make_vocab_size_divisible_by=vocab_divisor(out["vocab_size"]), normalization="RMSNorm",
               gated_linear_unit=True, add_bias_linear=False, add_qkv_bias=False, hidden_dropout=0.0)
    out = _ordered(out)
    out.update(dtype_fields(cfg))
    return out


def decoder_shape_hf(p: Any) -> dict[str, Any]:
    """config.json's sizes, norm epsilon, dropout, init and tied embeddings of a decoder without linear biases
    (``decoder_shape``'s export)."""
    fields = export_fields(DECODER_FIELDS, p)
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps")
    return dict({k: fields[k] for k in keys}, attention_bias=False, attention_dropout=fields["attention_dropout"],
                initializer_range=fields["initializer_range"], tie_word_embeddings=fields["tie_word_embeddings"])


def decoder_hf(p: Any, family: str) -> dict[str, Any]:
    """config.json entries of a standard decoder provider (exported as ``family``)."""
    act = hf_activation(p)
    rotary = p.position_embedding_type in ("rope", "yarn")
    if act is None or not p.gated_linear_unit or p.normalization != "RMSNorm" or not rotary:
        raise NotSupportedError(
            f"this model has no {family}-style HF equivalent (needs RMSNorm, RoPE and a gated silu/gelu MLP)"
        )
    if p.add_qkv_bias and not p.add_bias_linear:
        raise NotSupportedError(f"add_qkv_bias without add_bias_linear has no {family} equivalent "
                                "(a q/k/v bias alone: export it as an architecture that has one)")
    no_window(p, family)
    fields = export_fields(DECODER_FIELDS, p)
    out = dict(
        vocab_size=fields["vocab_size"],
        hidden_size=fields["hidden_size"],
        intermediate_size=fields["intermediate_size"],
        num_hidden_layers=fields["num_hidden_layers"],
        num_attention_heads=fields["num_attention_heads"],
        num_key_value_heads=fields["num_key_value_heads"],
        head_dim=fields["head_dim"],
        max_position_embeddings=fields["max_position_embeddings"],
        rms_norm_eps=fields["rms_norm_eps"],
        hidden_act=act,
        tie_word_embeddings=fields["tie_word_embeddings"],
        attention_dropout=fields["attention_dropout"],
        initializer_range=fields["initializer_range"],
        attention_bias=bool(p.add_bias_linear),
        mlp_bias=bool(p.add_bias_linear),
    )
    out.update(rope_hf(p))
    return out


def no_window(p: Any, family: str) -> None:
    """Refuse a provider with a sliding window for a family that has none."""
    window = p.window_size
    if window is not None and window[0] != -1:
        raise NotSupportedError(
            f"window_size={list(window)!r}: {family} has no sliding-window attention (export it as an "
            "architecture with windows)"
        )


def provider_view(provider: P, **changes: Any) -> P:
    """A shallow copy of ``provider`` with a few fields replaced (the provider itself is not modified): how a
    family hands the shared translation the part of the model it writes (a family that writes its window itself
    shows the translation none). A copy, not a proxy, so the translation's type checks still see a provider."""
    view = copy.copy(provider)
    for name, value in changes.items():
        setattr(view, name, value)
    return view


NO_WINDOW = {"window_size": None, "window_attn_skip_freq": None}
"""``provider_view`` changes that hide the sliding window."""
