"""Config rules of the gated DeltaNet hybrids (``experimental_attention_variant='gated_delta_net'``): the layer
pattern ``linear_attention_freq``, the mixer's sizes, and the attention output gate. Which layer is what is the
models' (``longspan.models.layer_pattern.linear_attention_layer_flags``), after these checks.

The fields exist on ``GPTModelProvider`` only; they are read by name (``getattr`` with the value a provider
without them builds), as the other provider-specific rules do."""

from __future__ import annotations

from typing import Any

from longspan.core.errors import ConfigError, NotSupportedError

GATED_DELTA_NET = "gated_delta_net"

_SIZE_FIELDS = ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
                "linear_num_value_heads")


def _field(config: Any, name: str, default: Any) -> Any:
    return getattr(config, name, default)  # getattr: declared by some provider and dataset classes only


def check_linear_attention_freq(freq: Any, num_layers: int) -> None:
    """``linear_attention_freq``: a positive int N ((N-1) linear layers then one full-attention layer) or a 0/1
    list with one entry per layer (1 = linear attention)."""
    if isinstance(freq, bool) or not isinstance(freq, (int, list, tuple)):
        raise ConfigError(f"model.linear_attention_freq={freq!r} must be a positive int or a 0/1 list per layer")
    if isinstance(freq, int):
        if freq < 1:
            raise ConfigError(f"model.linear_attention_freq={freq} must be >= 1 (or a 0/1 list per layer)")
        return
    if len(freq) != num_layers or any(x not in (0, 1) or isinstance(x, float) for x in freq):
        raise ConfigError(
            f"model.linear_attention_freq={list(freq)!r} must hold one 0/1 entry per layer ({num_layers} layers; "
            "1 = linear attention, 0 = full attention)"
        )


def check_linear_attention(config: Any) -> None:
    """The gated DeltaNet fields: valid values, and the combinations longspan builds (one line each, naming the
    field, its value and what would be valid)."""
    variant = _field(config, "experimental_attention_variant", None)
    freq = _field(config, "linear_attention_freq", None)
    if _field(config, "attention_output_gate", False) and config.multi_latent_attention:
        raise NotSupportedError("model.attention_output_gate=True is not supported with multi_latent_attention: "
                                "the gate is built for the standard attention")
    if variant is None:
        if freq is not None:
            raise ConfigError(f"model.linear_attention_freq={freq!r} needs "
                              f"model.experimental_attention_variant='{GATED_DELTA_NET}' (or unset it)")
        return
    if variant != GATED_DELTA_NET:
        raise NotSupportedError(
            f"model.experimental_attention_variant={variant!r} is not supported: use '{GATED_DELTA_NET}' or None")
    if freq is None:
        raise ConfigError(f"model.experimental_attention_variant='{GATED_DELTA_NET}' needs "
                          "model.linear_attention_freq (an int N or a 0/1 list per layer)")
    check_linear_attention_freq(freq, config.num_layers)
    for name in _SIZE_FIELDS:
        value = _field(config, name, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"model.{name}={value!r} must be a positive integer")
    key_heads = _field(config, "linear_num_key_heads", 1)
    value_heads = _field(config, "linear_num_value_heads", 1)
    if value_heads % key_heads:
        raise ConfigError(f"model.linear_num_value_heads={value_heads} must be a multiple of "
                          f"model.linear_num_key_heads={key_heads} (consecutive value heads share a key head)")
    tp = config.tensor_model_parallel_size
    for name, heads in (("linear_num_key_heads", key_heads), ("linear_num_value_heads", value_heads)):
        if heads % tp:
            raise ConfigError(f"model.{name}={heads} is not divisible by tensor_model_parallel_size={tp}: "
                              "each rank holds whole gated DeltaNet heads")
    if config.multi_latent_attention:
        raise NotSupportedError(f"model.experimental_attention_variant='{GATED_DELTA_NET}' is not supported with "
                                "multi_latent_attention: the full-attention layers are the standard attention")


def check_linear_attention_documents(cfg: Any) -> None:
    """Packed documents reach gated DeltaNet layers as ``cu_seqlens`` (the SFT packings give them); GPT data with
    ``reset_attention_mask`` separates documents only by the attention mask, which these layers do not read, so
    their state would run on from one document into the next."""
    if _field(cfg.model, "experimental_attention_variant", None) is None:
        return
    if _field(cfg.dataset, "reset_attention_mask", False):
        raise NotSupportedError(
            "dataset.reset_attention_mask=True is not supported with model.experimental_attention_variant="
            f"'{GATED_DELTA_NET}' (the GPT dataset gives no document boundaries for the linear layers' state): "
            "leave it False, or use packed SFT data")
