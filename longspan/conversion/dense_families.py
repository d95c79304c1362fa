"""Dense decoder families' config translations: Llama, Mistral, Ministral, Qwen2, Qwen3, Phi-3 and GPT-2."""

from __future__ import annotations

import copy
from typing import Any, TypeVar

from longspan.conversion.config_fields import (
    HF_ACTIVATIONS,
    dtype_fields,
    hf_activation,
    required,
    rope_fields,
    rope_hf,
    rope_scaling_kind,
    vocab_divisor,
    window_fields,
    window_hf,
)
from longspan.core.errors import NotSupportedError

P = TypeVar("P")


def llama_provider(cfg: dict[str, Any], eps_default: float = 1e-6) -> dict[str, Any]:
    act = cfg.get("hidden_act", "silu")
    if act not in HF_ACTIVATIONS:
        raise NotSupportedError(f"config.json hidden_act={act!r} is not supported: use one of {', '.join(HF_ACTIVATIONS)}")
    for key in ("sliding_window", "use_sliding_window"):
        if cfg.get(key) and (key == "use_sliding_window" or cfg.get("use_sliding_window", True)):
            raise NotSupportedError(
                f"config.json {key}={cfg[key]!r}: sliding-window attention is not supported by longspan; "
                "set it to null to convert with full attention"
            )
    attention_bias = bool(cfg.get("attention_bias", False))
    mlp_bias = bool(cfg.get("mlp_bias", False))
    if attention_bias and not mlp_bias and cfg.get("model_type") not in ("qwen2",):
        raise NotSupportedError(
            "config.json attention_bias=true with mlp_bias=false (a bias on o_proj but not the MLP) is not supported"
        )
    heads = required(cfg, "num_attention_heads")
    vocab = required(cfg, "vocab_size")
    out: dict[str, Any] = dict(
        num_layers=required(cfg, "num_hidden_layers"),
        hidden_size=required(cfg, "hidden_size"),
        ffn_hidden_size=required(cfg, "intermediate_size"),
        num_attention_heads=heads,
        num_query_groups=cfg.get("num_key_value_heads") or heads,
        kv_channels=cfg.get("head_dim") or required(cfg, "hidden_size") // heads,
        seq_length=cfg.get("max_position_embeddings", 4096),
        vocab_size=vocab,
        make_vocab_size_divisible_by=vocab_divisor(vocab),
        normalization="RMSNorm",
        layernorm_epsilon=float(cfg.get("rms_norm_eps", eps_default)),
        gated_linear_unit=True,
        activation_func=HF_ACTIVATIONS[act],
        add_bias_linear=attention_bias and mlp_bias,
        add_qkv_bias=attention_bias,
        share_embeddings_and_output_weights=bool(cfg.get("tie_word_embeddings", False)),
        attention_dropout=float(cfg.get("attention_dropout", 0.0)),
        hidden_dropout=0.0,
        init_method_std=float(cfg.get("initializer_range", 0.02)),
    )
    out.update(rope_fields(cfg))
    out.update(dtype_fields(cfg))
    return out


def llama_hf(p: Any) -> dict[str, Any]:
    act = hf_activation(p)
    rotary = p.position_embedding_type in ("rope", "yarn")
    if act is None or not p.gated_linear_unit or p.normalization != "RMSNorm" or not rotary:
        raise NotSupportedError(
            "this model has no Llama-style HF equivalent (needs RMSNorm, RoPE and a gated silu/gelu MLP)"
        )
    if p.add_qkv_bias and not p.add_bias_linear:
        raise NotSupportedError("add_qkv_bias without add_bias_linear exports as Qwen2, not Llama")
    _no_window(p, "Llama")
    out = dict(
        vocab_size=p.vocab_size,
        hidden_size=p.hidden_size,
        intermediate_size=p.ffn_hidden_size,
        num_hidden_layers=p.num_layers,
        num_attention_heads=p.num_attention_heads,
        num_key_value_heads=p.num_query_groups or p.num_attention_heads,
        head_dim=p.kv_channels or p.hidden_size // p.num_attention_heads,
        max_position_embeddings=p.seq_length,
        rms_norm_eps=p.layernorm_epsilon,
        hidden_act=act,
        tie_word_embeddings=bool(p.share_embeddings_and_output_weights),
        attention_dropout=float(p.attention_dropout),
        initializer_range=float(p.init_method_std),
        attention_bias=bool(p.add_bias_linear),
        mlp_bias=bool(p.add_bias_linear),
    )
    out.update(rope_hf(p))
    return out


def window_size_from_hf(sliding_window: Any, key: str = "sliding_window") -> list[int] | None:
    """HF's ``sliding_window`` (positions a token attends to, itself included) as Megatron's ``window_size``
    ``[W - 1, 0]``; None (or 0) = full attention."""
    if sliding_window is None or sliding_window == 0:
        return None
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
        raise NotSupportedError(f"config.json {key}={sliding_window!r} must be a positive integer or null")
    return [sliding_window - 1, 0]


def hf_sliding_window(p: Any, family: str) -> int | None:
    """A provider's window as HF's ``sliding_window`` of a family whose every layer uses it (Mistral)."""
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
    window = window_size_from_hf(cfg.get("sliding_window"))
    return dict(llama_provider(dict(cfg, sliding_window=None)), window_size=window)


def mistral_hf(p: Any) -> dict[str, Any]:
    out = llama_hf(provider_view(p, window_size=None, window_attn_skip_freq=None))
    for key in ("attention_bias", "mlp_bias"):
        if out.pop(key):
            raise NotSupportedError("Mistral has no linear biases: export this model as Llama")
    return dict(out, sliding_window=hf_sliding_window(p, "Mistral"))


# A provider seen without its window, for llama_hf (the family's own translation writes the window).
NO_WINDOW = {"window_size": None, "window_attn_skip_freq": None}


def qwen2_provider(cfg: dict[str, Any]) -> dict[str, Any]:
    # transformers' Qwen2: the window applies only with use_sliding_window, on the layers layer_types marks
    # (default: layers >= max_window_layers).
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    layers = required(cfg, "num_hidden_layers")
    layer_types = cfg.get("layer_types")
    if window is not None and not layer_types:
        first_sliding = cfg.get("max_window_layers", 28)
        layer_types = ["sliding_attention" if i >= first_sliding else "full_attention" for i in range(layers)]
    out = llama_provider(dict(cfg, attention_bias=False, use_sliding_window=False, sliding_window=None))
    out["add_qkv_bias"] = True  # Qwen2 always has q/k/v biases (and none elsewhere)
    return dict(out, **window_fields(window, layer_types, layers))


def qwen2_hf(p: Any) -> dict[str, Any]:
    if not p.add_qkv_bias or p.add_bias_linear:
        raise NotSupportedError("Qwen2 needs add_qkv_bias=True and add_bias_linear=False")
    out = llama_hf(provider_view(p, add_qkv_bias=False, **NO_WINDOW))
    for key in ("attention_bias", "mlp_bias"):
        out.pop(key)
    window, layer_types = window_hf(p)
    if window is None:
        return dict(out, use_sliding_window=False, sliding_window=None)
    full_prefix = layer_types.index("sliding_attention")
    return dict(out, use_sliding_window=True, sliding_window=window, max_window_layers=full_prefix,
                layer_types=layer_types)


def ministral_provider(cfg: dict[str, Any]) -> dict[str, Any]:
    """Ministral (8B): Mistral's layout with a sliding window on the layers ``layer_types`` marks (default:
    every layer when sliding_window is set)."""
    out = llama_provider(dict(cfg, sliding_window=None))
    return dict(out, **window_fields(cfg.get("sliding_window"), cfg.get("layer_types"),
                                     required(cfg, "num_hidden_layers")))


def ministral_hf(p: Any) -> dict[str, Any]:
    out = llama_hf(provider_view(p, **NO_WINDOW))
    for key in ("attention_bias", "mlp_bias"):
        if out.pop(key):
            raise NotSupportedError("Ministral has no linear biases: export this model as Llama")
    window, layer_types = window_hf(p)
    return dict(out, sliding_window=window, layer_types=layer_types)


def qwen3_provider(cfg: dict[str, Any]) -> dict[str, Any]:
    return dict(llama_provider(cfg), qk_layernorm=True)


def qwen3_hf(p: Any) -> dict[str, Any]:
    if not p.qk_layernorm:
        raise NotSupportedError("Qwen3 needs qk_layernorm=True")
    out = llama_hf(p)
    out.pop("mlp_bias")
    return dict(out, use_sliding_window=False, sliding_window=None)


# transformers' Phi3Config reads these rope_type spellings as LongRoPE, and its original_max_position_embeddings
# (top level, default 4096) overrides the rope dict's.
PHI3_LONGROPE_ALIASES = ("su", "yarn", "longrope")
PHI3_ORIGINAL_MAX_POSITIONS = 4096


def phi3_provider(cfg: dict[str, Any]) -> dict[str, Any]:
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope_type = params.pop("type", None) or params.get("rope_type", "default")
    if rope_type in PHI3_LONGROPE_ALIASES:
        rope_type = "longrope"
    if rope_type not in ("default", "longrope"):
        raise NotSupportedError(
            f"config.json rope_type={rope_type!r} is not supported for Phi-3: use 'default' or 'longrope' ('su')"
        )
    params["rope_type"] = rope_type
    resid, embd = cfg.get("resid_pdrop", 0.0), cfg.get("embd_pdrop", 0.0)
    if resid != embd:
        raise NotSupportedError(
            f"config.json resid_pdrop={resid} with embd_pdrop={embd}: longspan has one hidden_dropout for both"
        )
    original = cfg.get("original_max_position_embeddings") or PHI3_ORIGINAL_MAX_POSITIONS
    hf = dict(cfg, rope_parameters=params, rope_scaling=None, original_max_position_embeddings=original,
              attention_bias=False, mlp_bias=False, sliding_window=None)
    out = dict(llama_provider(hf, eps_default=1e-5), hidden_dropout=float(resid))
    # transformers' Phi-3 windows every layer when sliding_window is set
    return dict(out, **window_fields(cfg.get("sliding_window"), None, required(cfg, "num_hidden_layers")))


def phi3_hf(p: Any) -> dict[str, Any]:
    kind = rope_scaling_kind(p)
    if kind not in ("default", "longrope"):
        raise NotSupportedError(f"Phi-3 takes default or longrope RoPE, not {kind}: export this model as Llama")
    if p.add_qkv_bias:
        raise NotSupportedError("Phi-3 has no linear biases: export this model as Llama or Qwen2")
    out = llama_hf(provider_view(p, **NO_WINDOW))
    for key in ("attention_bias", "mlp_bias"):
        if out.pop(key):
            raise NotSupportedError("Phi-3 has no linear biases: export this model as Llama")
    window, layer_types = window_hf(p)
    if window is not None and "full_attention" in layer_types:
        raise NotSupportedError("Phi-3 windows every layer or none: this model mixes windowed and full layers")
    original = p.rope_original_max_position_embeddings if kind == "longrope" else p.seq_length
    dropout = float(p.hidden_dropout)
    return dict(out, resid_pdrop=dropout, embd_pdrop=dropout, original_max_position_embeddings=int(original),
                sliding_window=window)


def gpt2_provider(cfg: dict[str, Any]) -> dict[str, Any]:
    act = cfg.get("activation_function", "gelu_new")
    if act not in HF_ACTIVATIONS:
        raise NotSupportedError(
            f"config.json activation_function={act!r} is not supported: use one of {', '.join(HF_ACTIVATIONS)}"
        )
    for key in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention"):
        if cfg.get(key):
            raise NotSupportedError(f"config.json {key}=true is not supported")
    if cfg.get("scale_attn_weights") is False:
        raise NotSupportedError("config.json scale_attn_weights=false is not supported")
    hidden = required(cfg, "n_embd")
    vocab = required(cfg, "vocab_size")
    out = dict(
        num_layers=required(cfg, "n_layer"),
        hidden_size=hidden,
        ffn_hidden_size=cfg.get("n_inner") or 4 * hidden,
        num_attention_heads=required(cfg, "n_head"),
        seq_length=required(cfg, "n_positions"),
        vocab_size=vocab,
        make_vocab_size_divisible_by=vocab_divisor(vocab),
        normalization="LayerNorm",
        layernorm_epsilon=float(cfg.get("layer_norm_epsilon", 1e-5)),
        position_embedding_type="learned_absolute",
        gated_linear_unit=False,
        activation_func=HF_ACTIVATIONS[act],
        add_bias_linear=True,
        add_qkv_bias=False,
        share_embeddings_and_output_weights=bool(cfg.get("tie_word_embeddings", True)),
        attention_dropout=float(cfg.get("attn_pdrop", 0.1)),
        hidden_dropout=float(cfg.get("resid_pdrop", 0.1)),
        init_method_std=float(cfg.get("initializer_range", 0.02)),
    )
    out.update(dtype_fields(cfg))
    return out


def gpt2_hf(p: Any) -> dict[str, Any]:
    if p.normalization != "LayerNorm" or p.position_embedding_type != "learned_absolute" or p.gated_linear_unit:
        raise NotSupportedError("GPT-2 needs LayerNorm, learned absolute positions and a plain gelu MLP")
    _no_window(p, "GPT-2")
    return dict(
        vocab_size=p.vocab_size, n_positions=p.seq_length, n_embd=p.hidden_size, n_layer=p.num_layers,
        n_head=p.num_attention_heads, n_inner=p.ffn_hidden_size, activation_function=hf_activation(p),
        layer_norm_epsilon=p.layernorm_epsilon, resid_pdrop=float(p.hidden_dropout),
        embd_pdrop=float(p.hidden_dropout), attn_pdrop=float(p.attention_dropout),
        initializer_range=float(p.init_method_std), tie_word_embeddings=bool(p.share_embeddings_and_output_weights),
    )


def _no_window(p: Any, family: str) -> None:
    window = p.window_size
    if window is not None and window[0] != -1:
        raise NotSupportedError(
            f"window_size={list(window)!r}: {family} has no sliding-window attention (export as Mistral)"
        )


def provider_view(provider: P, **changes: Any) -> P:
    """A shallow copy of ``provider`` with a few fields replaced (the provider itself is not modified)."""
    view = copy.copy(provider)
    for name, value in changes.items():
        setattr(view, name, value)
    return view
