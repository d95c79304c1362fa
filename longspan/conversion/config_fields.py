"""config.json <-> provider field helpers shared by every family's translation: dtypes, RoPE, activations.

Configs are handled as the plain ``config.json`` dicts (transformers is not needed to convert). Both
spellings of RoPE settings are read: transformers 5's ``rope_parameters`` and the older ``rope_theta`` /
``rope_scaling``; exports write ``rope_parameters`` plus ``rope_theta`` so older readers find it too.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from longspan.core.errors import ConfigError, NotSupportedError
from longspan.models.activations import gelu_tanh

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


def rope_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Provider RoPE fields from either spelling of config.json's RoPE settings (default or llama3 scaling)."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
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
            old_context_len=int(params.get("original_max_position_embeddings", 8192)),
        )
    elif rope_type != "default":
        raise NotSupportedError(
            f"config.json rope_type={rope_type!r} is not supported: longspan implements 'default' and 'llama3'"
        )
    return out


def rope_hf(p: Any) -> dict[str, Any]:
    """config.json RoPE keys for provider ``p``, in both the transformers 5 and the older spelling."""
    params: dict[str, Any] = {"rope_theta": float(p.rotary_base), "rope_type": "default"}
    if p.rope_scaling:
        params.update(rope_type="llama3", factor=float(p.rope_scaling_factor), low_freq_factor=float(p.low_freq_factor),
                      high_freq_factor=float(p.high_freq_factor),
                      original_max_position_embeddings=int(p.old_context_len))
    if p.rotary_percent != 1.0:
        params["partial_rotary_factor"] = float(p.rotary_percent)
    # transformers < 5 reads rope_theta / rope_scaling; 5 reads rope_parameters (and accepts the others).
    scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")}
    return {"rope_parameters": params, "rope_theta": params["rope_theta"],
            "rope_scaling": scaling if p.rope_scaling else None}


def hf_activation(p: Any) -> str | None:
    """The HF ``hidden_act`` name of ``p.activation_func`` (None when HF has no name for it)."""
    return {F.silu: "silu", F.gelu: "gelu", gelu_tanh: "gelu_new"}.get(p.activation_func)
