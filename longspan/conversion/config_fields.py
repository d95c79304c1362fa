"""config.json <-> provider field helpers shared by every family's translation: dtypes, RoPE, activations.

Configs are handled as the plain ``config.json`` dicts (transformers is not needed to convert). Both
spellings of RoPE settings are read: transformers 5's ``rope_parameters`` and the older ``rope_theta`` /
``rope_scaling``; exports write ``rope_parameters`` plus ``rope_theta`` so older readers find it too.

RoPE scalings map to the provider as: ``linear`` -> ``seq_len_interpolation_factor``; ``llama3`` ->
``rope_scaling`` + ``rope_scaling_factor`` / ``low_freq_factor`` / ``high_freq_factor`` / ``old_context_len``;
``yarn`` -> ``position_embedding_type='yarn'`` + the ``yarn_*`` fields (Megatron's names); ``dynamic`` ->
``rope_dynamic_factor`` + ``rope_original_max_position_embeddings`` (HF's ``max_position_embeddings``);
``longrope`` -> ``rope_longrope_short_factor`` / ``rope_longrope_long_factor`` +
``rope_original_max_position_embeddings`` + ``rope_attention_factor`` (written out even when config.json
leaves it to transformers' default, so a changed ``seq_length`` cannot change it).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Union

import torch
import torch.nn.functional as F

from longspan.core.errors import ConfigError, NotSupportedError
from longspan.models.activations import gelu_tanh
from longspan.models.gpt_provider import GPTModelProvider
from longspan.models.layer_pattern import (
    layer_types_from_windows,
    layer_windows,
    window_pattern_from_layer_types,
)
from longspan.models.rope import ROPE_SCALING_TYPES

if TYPE_CHECKING:
    from longspan.models.mamba_provider import MambaProvider
    from longspan.models.t5_provider import T5ModelProvider

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
HF_ACTIVATIONS = {"silu": F.silu, "swish": F.silu, "gelu": F.gelu, "gelu_new": gelu_tanh, "gelu_pytorch_tanh": gelu_tanh}


def required(cfg: dict[str, Any], key: str) -> Any:
    """``cfg[key]``, or a ConfigError naming the missing key."""
    if cfg.get(key) is None:
        raise ConfigError(f"config.json has no {key!r}, which a {cfg.get('model_type', '?')} model needs")
    return cfg[key]


def vocab_divisor(vocab_size: int) -> int:
    """The largest power of two <= 128 dividing ``vocab_size``: no padding rows (Megatron Bridge's choice)."""
    divisor = 128
    while vocab_size % divisor:
        divisor //= 2
    return divisor


def _whole(x: float) -> float | int:
    return int(x) if float(x).is_integer() else float(x)


def dtype_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """The provider's ``params_dtype`` from config.json's ``dtype`` (or ``torch_dtype``)."""
    name = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    if name not in DTYPES:
        raise NotSupportedError(f"config.json dtype={name!r} is not supported: use one of {', '.join(DTYPES)}")
    return {"params_dtype": DTYPES[name]}


ROPE_TYPES = ("default",) + ROPE_SCALING_TYPES


def _rope_params(cfg: dict[str, Any]) -> tuple[dict[str, Any], str]:
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise NotSupportedError(
            f"config.json rope_type={rope_type!r} is not supported: longspan implements {', '.join(ROPE_TYPES)}"
        )
    return params, rope_type


def _original_length(cfg: dict[str, Any], params: dict[str, Any]) -> int:
    """transformers' rule: a top-level original_max_position_embeddings wins (Phi-3), then the rope dict's,
    then max_position_embeddings."""
    for value in (cfg.get("original_max_position_embeddings"), params.get("original_max_position_embeddings")):
        if value is not None:
            return int(value)
    return int(required(cfg, "max_position_embeddings"))


def rope_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Provider RoPE fields from either spelling of config.json's RoPE settings (every rope_type of
    ``ROPE_TYPES``, with transformers' defaults for the keys a config leaves out)."""
    params, rope_type = _rope_params(cfg)
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    out: dict[str, Any] = {"position_embedding_type": "rope", "rotary_base": _whole(theta)}
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        out["rotary_percent"] = float(partial)
    if rope_type == "llama3":
        out.update(
            rope_scaling=True,
            rope_scaling_factor=float(params["factor"]),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            old_context_len=_original_length(cfg, params),
        )
    elif rope_type == "linear":
        out["seq_len_interpolation_factor"] = float(params["factor"])
    elif rope_type == "dynamic":
        out.update(rope_dynamic_factor=float(params["factor"]),
                   rope_original_max_position_embeddings=int(required(cfg, "max_position_embeddings")))
    elif rope_type == "yarn":
        out.update(_yarn_fields(cfg, params))
    elif rope_type == "longrope":
        out.update(_longrope_fields(cfg, params))
    return out


def _yarn_fields(cfg: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    original = _original_length(cfg, params)
    factor = params.get("factor") or required(cfg, "max_position_embeddings") / original
    out: dict[str, Any] = dict(position_embedding_type="yarn", yarn_rotary_scaling_factor=float(factor),
                               yarn_original_max_position_embeddings=original,
                               yarn_beta_fast=float(params.get("beta_fast") or 32.0),
                               yarn_beta_slow=float(params.get("beta_slow") or 1.0),
                               yarn_correction_range_round_to_int=bool(params.get("truncate", True)))
    if params.get("attention_factor") is not None:
        out["rope_attention_factor"] = float(params["attention_factor"])
    elif params.get("mscale") and params.get("mscale_all_dim"):
        out.update(yarn_mscale=float(params["mscale"]), yarn_mscale_all_dim=float(params["mscale_all_dim"]))
    return out


def _longrope_fields(cfg: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    original = _original_length(cfg, params)
    attention = params.get("attention_factor")
    if attention is None:  # transformers' default, from the factor (or the context extension ratio)
        factor = params.get("factor") or required(cfg, "max_position_embeddings") / original
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return dict(rope_longrope_short_factor=[float(x) for x in params["short_factor"]],
                rope_longrope_long_factor=[float(x) for x in params["long_factor"]],
                rope_original_max_position_embeddings=original, rope_attention_factor=float(attention))


def rope_scaling_kind(p: Union[GPTModelProvider, MambaProvider, T5ModelProvider]) -> str:
    """The HF rope_type provider ``p`` exports as (one-line error for combinations HF cannot express)."""
    gpt = isinstance(p, GPTModelProvider)  # the other providers have none of these scalings
    kinds = [kind for kind, on in (
        ("llama3", gpt and bool(p.rope_scaling)),
        ("yarn", p.position_embedding_type == "yarn"),
        ("dynamic", gpt and p.rope_dynamic_factor is not None),
        ("longrope", gpt and p.rope_longrope_short_factor is not None),
    ) if on]
    if p.seq_len_interpolation_factor is not None:
        if kinds:
            raise NotSupportedError(
                f"seq_len_interpolation_factor with {kinds[0]} RoPE scaling has no HF equivalent: use one of them"
            )
        return "linear"
    return kinds[0] if kinds else "default"


def rope_hf(p: Any) -> dict[str, Any]:
    """config.json RoPE keys for provider ``p``, in both the transformers 5 and the older spelling."""
    kind = rope_scaling_kind(p)
    params: dict[str, Any] = {"rope_theta": float(p.rotary_base), "rope_type": kind}
    extra: dict[str, Any] = {}
    if kind == "llama3":
        params.update(factor=float(p.rope_scaling_factor), low_freq_factor=float(p.low_freq_factor),
                      high_freq_factor=float(p.high_freq_factor),
                      original_max_position_embeddings=int(p.old_context_len))
    elif kind == "linear":
        params["factor"] = float(p.seq_len_interpolation_factor)
    elif kind == "dynamic":
        # transformers scales from max_position_embeddings: it is the original length here
        params["factor"] = float(p.rope_dynamic_factor)
        extra["max_position_embeddings"] = int(p.rope_original_max_position_embeddings)
    elif kind == "yarn":
        params.update(_yarn_hf(p))
    elif kind == "longrope":
        params.update(short_factor=[float(x) for x in p.rope_longrope_short_factor],
                      long_factor=[float(x) for x in p.rope_longrope_long_factor],
                      original_max_position_embeddings=int(p.rope_original_max_position_embeddings),
                      attention_factor=float(p.rope_attention_factor))
    if p.rotary_percent != 1.0:
        params["partial_rotary_factor"] = float(p.rotary_percent)
        extra["partial_rotary_factor"] = float(p.rotary_percent)  # where Phi-3's config reads it
    # transformers < 5 reads rope_theta / rope_scaling; 5 reads rope_parameters (and accepts the others).
    scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")}
    return {"rope_parameters": params, "rope_theta": params["rope_theta"],
            "rope_scaling": scaling if kind != "default" else None, **extra}


def _yarn_hf(p: Any) -> dict[str, Any]:
    out: dict[str, Any] = dict(factor=float(p.yarn_rotary_scaling_factor),
                               original_max_position_embeddings=int(p.yarn_original_max_position_embeddings),
                               beta_fast=float(p.yarn_beta_fast or 32.0), beta_slow=float(p.yarn_beta_slow or 1.0))
    if not p.yarn_correction_range_round_to_int:
        out["truncate"] = False
    mscale = 1.0 if p.yarn_mscale is None else float(p.yarn_mscale)
    all_dim = float(p.yarn_mscale_all_dim or 0.0)
    if p.rope_attention_factor is not None:
        out["attention_factor"] = float(p.rope_attention_factor)
    elif mscale and all_dim:
        out.update(mscale=mscale, mscale_all_dim=all_dim)
    elif mscale != 1.0:  # transformers ignores mscale without mscale_all_dim: write the factor it stands for
        factor = float(p.yarn_rotary_scaling_factor)
        out["attention_factor"] = 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0
    return out


def window_fields(window: int | None, layer_types: list[str] | None, num_layers: int) -> dict[str, Any]:
    """Provider fields for HF's ``sliding_window`` (the positions a token attends to, itself included) on the
    layers ``layer_types`` marks ``sliding_attention`` (None: every layer): Megatron's ``window_size=[W - 1, 0]``
    and, when only some layers slide, ``window_attn_skip_freq`` as their 0/1 pattern."""
    if window is None:
        return {}
    pattern = window_pattern_from_layer_types(layer_types) if layer_types else [1] * num_layers
    if not any(pattern):
        return {}
    return {"window_size": [int(window) - 1, 0], "window_attn_skip_freq": None if all(pattern) else pattern}


def window_hf(p: Any) -> tuple[int | None, list[str]]:
    """(HF ``sliding_window``, HF ``layer_types``) of provider ``p``; one window size for all sliding layers."""
    windows = layer_windows(p)
    sizes = sorted({w for w in windows if w is not None})
    if len(sizes) > 1:
        raise NotSupportedError(f"layer windows {sizes} differ: HF configs hold one sliding_window")
    return (sizes[0] if sizes else None), layer_types_from_windows(windows)


def hf_activation(p: Any) -> str | None:
    """The HF ``hidden_act`` name of ``p.activation_func`` (None when HF has no name for it)."""
    return {F.silu: "silu", F.gelu: "gelu", gelu_tanh: "gelu_new"}.get(p.activation_func)
