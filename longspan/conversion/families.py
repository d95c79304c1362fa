"""The supported Hugging Face architectures: config.json <-> GPTModelProvider fields, and the weight table.

Configs are handled as the plain ``config.json`` dicts (transformers is not needed to convert). Both
spellings of RoPE settings are read: transformers 5's ``rope_parameters`` and the older ``rope_theta`` /
``rope_scaling``; exports write ``rope_parameters`` plus ``rope_theta`` so older readers find it too.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
import torch.nn.functional as F

import longspan.conversion.mapping as mapping
from longspan.core.errors import ConfigError, NotSupportedError
from longspan.models.activations import gelu_tanh, squared_relu

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}
_ACTIVATIONS = {"silu": F.silu, "swish": F.silu, "gelu": F.gelu, "gelu_new": gelu_tanh, "gelu_pytorch_tanh": gelu_tanh}


@dataclass(frozen=True)
class Family:
    """One HF architecture: its names, weight table and config translation."""

    name: str
    architecture: str
    model_type: str
    weights: tuple[mapping.WeightMap, ...]
    to_provider: Callable[[dict[str, Any]], dict[str, Any]]
    """config.json dict -> GPTModelProvider keyword arguments."""
    to_hf: Callable[[Any], dict[str, Any]]
    """GPTModelProvider -> config.json dict (without architectures/model_type/dtype)."""
    provider_class: str = "GPTModelProvider"
    """The ``longspan.models`` provider class ``to_provider``'s fields are for."""
    weights_for: Callable[[dict[str, Any]], tuple[mapping.WeightMap, ...]] | None = None
    """When set, the weight table depends on config.json (T5's gated or plain MLP): it replaces ``weights``."""

    def for_config(self, cfg: dict[str, Any]) -> "Family":
        """This family with the weight table for config.json dict ``cfg``."""
        return self if self.weights_for is None else replace(self, weights=self.weights_for(cfg))


def _need(cfg: dict[str, Any], key: str) -> Any:
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


def _dtype_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    name = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    if name not in _DTYPES:
        raise NotSupportedError(f"config.json dtype={name!r} is not supported: use one of {', '.join(_DTYPES)}")
    return {"params_dtype": _DTYPES[name]}


def _rope_fields(cfg: dict[str, Any]) -> dict[str, Any]:
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


def _rope_hf(p: Any) -> dict[str, Any]:
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


def _hf_activation(p: Any) -> str | None:
    return {F.silu: "silu", F.gelu: "gelu", gelu_tanh: "gelu_new"}.get(p.activation_func)


def _llama_provider(cfg: dict[str, Any], eps_default: float = 1e-6) -> dict[str, Any]:
    act = cfg.get("hidden_act", "silu")
    if act not in _ACTIVATIONS:
        raise NotSupportedError(f"config.json hidden_act={act!r} is not supported: use one of {', '.join(_ACTIVATIONS)}")
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
    heads = _need(cfg, "num_attention_heads")
    vocab = _need(cfg, "vocab_size")
    out: dict[str, Any] = dict(
        num_layers=_need(cfg, "num_hidden_layers"),
        hidden_size=_need(cfg, "hidden_size"),
        ffn_hidden_size=_need(cfg, "intermediate_size"),
        num_attention_heads=heads,
        num_query_groups=cfg.get("num_key_value_heads") or heads,
        kv_channels=cfg.get("head_dim") or _need(cfg, "hidden_size") // heads,
        seq_length=cfg.get("max_position_embeddings", 4096),
        vocab_size=vocab,
        make_vocab_size_divisible_by=vocab_divisor(vocab),
        normalization="RMSNorm",
        layernorm_epsilon=float(cfg.get("rms_norm_eps", eps_default)),
        gated_linear_unit=True,
        activation_func=_ACTIVATIONS[act],
        add_bias_linear=attention_bias and mlp_bias,
        add_qkv_bias=attention_bias,
        share_embeddings_and_output_weights=bool(cfg.get("tie_word_embeddings", False)),
        attention_dropout=float(cfg.get("attention_dropout", 0.0)),
        hidden_dropout=0.0,
        init_method_std=float(cfg.get("initializer_range", 0.02)),
    )
    out.update(_rope_fields(cfg))
    out.update(_dtype_fields(cfg))
    return out


def _llama_hf(p: Any) -> dict[str, Any]:
    act = _hf_activation(p)
    if act is None or not p.gated_linear_unit or p.normalization != "RMSNorm" or p.position_embedding_type != "rope":
        raise NotSupportedError(
            "this model has no Llama-style HF equivalent (needs RMSNorm, RoPE and a gated silu/gelu MLP)"
        )
    if p.add_qkv_bias and not p.add_bias_linear:
        raise NotSupportedError("add_qkv_bias without add_bias_linear exports as Qwen2, not Llama")
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
    out.update(_rope_hf(p))
    return out


def _mistral_provider(cfg: dict[str, Any]) -> dict[str, Any]:
    return _llama_provider(cfg)


def _mistral_hf(p: Any) -> dict[str, Any]:
    out = _llama_hf(p)
    for key in ("attention_bias", "mlp_bias"):
        if out.pop(key):
            raise NotSupportedError("Mistral has no linear biases: export this model as Llama")
    return dict(out, sliding_window=None)


def _qwen2_provider(cfg: dict[str, Any]) -> dict[str, Any]:
    out = _llama_provider(dict(cfg, attention_bias=False))
    out["add_qkv_bias"] = True  # Qwen2 always has q/k/v biases (and none elsewhere)
    return out


def _qwen2_hf(p: Any) -> dict[str, Any]:
    if not p.add_qkv_bias or p.add_bias_linear:
        raise NotSupportedError("Qwen2 needs add_qkv_bias=True and add_bias_linear=False")
    out = _llama_hf(_ProviderView(p, add_qkv_bias=False))
    for key in ("attention_bias", "mlp_bias"):
        out.pop(key)
    return dict(out, use_sliding_window=False, sliding_window=None)


def _qwen3_provider(cfg: dict[str, Any]) -> dict[str, Any]:
    return dict(_llama_provider(cfg), qk_layernorm=True)


def _qwen3_hf(p: Any) -> dict[str, Any]:
    if not p.qk_layernorm:
        raise NotSupportedError("Qwen3 needs qk_layernorm=True")
    out = _llama_hf(p)
    out.pop("mlp_bias")
    return dict(out, use_sliding_window=False, sliding_window=None)


def _mixtral_provider(cfg: dict[str, Any]) -> dict[str, Any]:
    out = _llama_provider(cfg, eps_default=1e-5)
    # HF Mixtral: softmax over all experts, top-k, renormalized = softmax over the top-k logits
    # (longspan's default, moe_router_pre_softmax=False).
    out.update(
        num_moe_experts=_need(cfg, "num_local_experts"),
        moe_router_topk=cfg.get("num_experts_per_tok", 2),
        moe_ffn_hidden_size=cfg["intermediate_size"],
        moe_router_pre_softmax=False,
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=float(cfg.get("router_aux_loss_coef", 0.0)),
    )
    if cfg.get("router_jitter_noise"):
        raise NotSupportedError(f"config.json router_jitter_noise={cfg['router_jitter_noise']} is not supported")
    return out


def _mixtral_hf(p: Any) -> dict[str, Any]:
    if p.moe_router_pre_softmax or p.moe_layer_freq not in (1, [1] * p.num_layers) or p.moe_shared_expert_intermediate_size:
        raise NotSupportedError("Mixtral needs every layer MoE, moe_router_pre_softmax=False and no shared experts")
    out = _mistral_hf(p)
    out.update(num_local_experts=p.num_moe_experts, num_experts_per_tok=p.moe_router_topk,
               intermediate_size=p.moe_ffn_hidden_size or p.ffn_hidden_size,
               router_aux_loss_coef=float(_first(p.moe_aux_loss_coeff)))
    return out


def _first(value: Any) -> Any:
    return value[0] if isinstance(value, (list, tuple)) else value


def _qwen3_moe_provider(cfg: dict[str, Any]) -> dict[str, Any]:
    out = _qwen3_provider(cfg)
    layers = out["num_layers"]
    step = int(cfg.get("decoder_sparse_step", 1))
    dense = set(cfg.get("mlp_only_layers") or [])
    flags = [int(i not in dense and (i + 1) % step == 0) for i in range(layers)]
    # HF Qwen3-MoE: softmax over all experts, top-k; renormalized only with norm_topk_prob.
    out.update(
        num_moe_experts=cfg.get("num_experts") or _need(cfg, "num_local_experts"),
        moe_router_topk=cfg.get("num_experts_per_tok", 8),
        moe_ffn_hidden_size=_need(cfg, "moe_intermediate_size"),
        moe_layer_freq=1 if all(flags) else flags,
        moe_router_pre_softmax=not bool(cfg.get("norm_topk_prob", False)),
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=float(cfg.get("router_aux_loss_coef", 0.0)),
    )
    return out


def _qwen3_moe_hf(p: Any) -> dict[str, Any]:
    if p.moe_shared_expert_intermediate_size:
        raise NotSupportedError("Qwen3-MoE has no shared experts")
    out = _qwen3_hf(p)
    freq = p.moe_layer_freq
    flags = [1] * p.num_layers if freq == 1 else list(freq)
    if isinstance(freq, int) and freq != 1:
        flags = [int(i % freq == 0) for i in range(p.num_layers)]
    out.update(num_experts=p.num_moe_experts, num_local_experts=p.num_moe_experts,
               num_experts_per_tok=p.moe_router_topk, moe_intermediate_size=p.moe_ffn_hidden_size or p.ffn_hidden_size,
               norm_topk_prob=not p.moe_router_pre_softmax, decoder_sparse_step=1,
               mlp_only_layers=[i for i, f in enumerate(flags) if not f],
               router_aux_loss_coef=float(_first(p.moe_aux_loss_coeff)))
    return out


def _gpt2_provider(cfg: dict[str, Any]) -> dict[str, Any]:
    act = cfg.get("activation_function", "gelu_new")
    if act not in _ACTIVATIONS:
        raise NotSupportedError(
            f"config.json activation_function={act!r} is not supported: use one of {', '.join(_ACTIVATIONS)}"
        )
    for key in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention"):
        if cfg.get(key):
            raise NotSupportedError(f"config.json {key}=true is not supported")
    if cfg.get("scale_attn_weights") is False:
        raise NotSupportedError("config.json scale_attn_weights=false is not supported")
    hidden = _need(cfg, "n_embd")
    vocab = _need(cfg, "vocab_size")
    out = dict(
        num_layers=_need(cfg, "n_layer"),
        hidden_size=hidden,
        ffn_hidden_size=cfg.get("n_inner") or 4 * hidden,
        num_attention_heads=_need(cfg, "n_head"),
        seq_length=_need(cfg, "n_positions"),
        vocab_size=vocab,
        make_vocab_size_divisible_by=vocab_divisor(vocab),
        normalization="LayerNorm",
        layernorm_epsilon=float(cfg.get("layer_norm_epsilon", 1e-5)),
        position_embedding_type="learned_absolute",
        gated_linear_unit=False,
        activation_func=_ACTIVATIONS[act],
        add_bias_linear=True,
        add_qkv_bias=False,
        share_embeddings_and_output_weights=bool(cfg.get("tie_word_embeddings", True)),
        attention_dropout=float(cfg.get("attn_pdrop", 0.1)),
        hidden_dropout=float(cfg.get("resid_pdrop", 0.1)),
        init_method_std=float(cfg.get("initializer_range", 0.02)),
    )
    out.update(_dtype_fields(cfg))
    return out


def _gpt2_hf(p: Any) -> dict[str, Any]:
    if p.normalization != "LayerNorm" or p.position_embedding_type != "learned_absolute" or p.gated_linear_unit:
        raise NotSupportedError("GPT-2 needs LayerNorm, learned absolute positions and a plain gelu MLP")
    return dict(
        vocab_size=p.vocab_size, n_positions=p.seq_length, n_embd=p.hidden_size, n_layer=p.num_layers,
        n_head=p.num_attention_heads, n_inner=p.ffn_hidden_size, activation_function=_hf_activation(p),
        layer_norm_epsilon=p.layernorm_epsilon, resid_pdrop=float(p.hidden_dropout),
        embd_pdrop=float(p.hidden_dropout), attn_pdrop=float(p.attention_dropout),
        initializer_range=float(p.init_method_std), tie_word_embeddings=bool(p.share_embeddings_and_output_weights),
    )


_T5_ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu, "gelu_new": gelu_tanh, "gelu_pytorch_tanh": gelu_tanh, "silu": F.silu}


def _t5_feed_forward(cfg: dict[str, Any]) -> tuple[bool, str]:
    """(gated, HF activation name) of config.json's ``feed_forward_proj`` ('relu', 'gated-gelu', ...)."""
    proj = cfg.get("feed_forward_proj", "relu")
    parts = proj.split("-")
    gated = len(parts) == 2 and parts[0] == "gated"
    act = "gelu_new" if gated and parts[-1] == "gelu" else parts[-1]  # transformers: gated-gelu is gelu_new
    if act not in _T5_ACTIVATIONS or len(parts) > (2 if gated else 1):
        raise NotSupportedError(
            f"config.json feed_forward_proj={proj!r} is not supported: use relu, gelu, gated-gelu or gated-silu"
        )
    return gated, act


def _t5_provider(cfg: dict[str, Any]) -> dict[str, Any]:
    gated, act = _t5_feed_forward(cfg)
    vocab = _need(cfg, "vocab_size")
    layers = _need(cfg, "num_layers")
    # transformers 5 writes scale_decoder_outputs; older configs scale exactly when the embeddings are tied.
    scale = cfg.get("scale_decoder_outputs", cfg.get("tie_word_embeddings", True) is not False)
    out = dict(
        num_layers=cfg.get("num_decoder_layers") or layers,
        encoder_num_layers=layers,
        hidden_size=_need(cfg, "d_model"),
        ffn_hidden_size=_need(cfg, "d_ff"),
        num_attention_heads=_need(cfg, "num_heads"),
        kv_channels=_need(cfg, "d_kv"),
        softmax_scale=1.0,  # T5 folds the 1/sqrt(d) into its initialization: attention is unscaled
        vocab_size=vocab,
        make_vocab_size_divisible_by=vocab_divisor(vocab),
        normalization="RMSNorm",
        layernorm_epsilon=float(cfg.get("layer_norm_epsilon", 1e-6)),
        position_embedding_type="relative",
        relative_attention_num_buckets=int(cfg.get("relative_attention_num_buckets", 32)),
        relative_attention_max_distance=int(cfg.get("relative_attention_max_distance", 128)),
        gated_linear_unit=gated,
        activation_func=_T5_ACTIVATIONS[act],
        add_bias_linear=False,
        share_embeddings_and_output_weights=bool(cfg.get("tie_word_embeddings", True)),
        scale_decoder_outputs=bool(scale),
        attention_dropout=float(cfg.get("dropout_rate", 0.1)),
        hidden_dropout=float(cfg.get("dropout_rate", 0.1)),
    )
    out.update(_dtype_fields(cfg))
    return out


def _t5_hf(p: Any) -> dict[str, Any]:
    act = {F.relu: "relu", F.gelu: "gelu", gelu_tanh: "gelu_new", F.silu: "silu"}.get(p.activation_func)
    if p.gated_linear_unit and act in ("gelu_new", "gelu"):
        act = "gelu" if act == "gelu_new" else None  # HF's gated-gelu is the tanh form; exact GeGLU has no name
    if (act is None or p.normalization != "RMSNorm" or p.position_embedding_type != "relative" or p.add_bias_linear
            or p.add_qkv_bias or p.softmax_scale != 1.0):
        raise NotSupportedError(
            "this T5 model has no HF T5 equivalent (needs RMSNorm, relative positions, no linear biases, "
            "softmax_scale=1.0 and a relu/gelu_tanh/silu MLP)"
        )
    layers = p.encoder_num_layers if p.encoder_num_layers is not None else p.num_layers
    return dict(
        vocab_size=p.vocab_size, d_model=p.hidden_size, d_kv=p.kv_channels or p.hidden_size // p.num_attention_heads,
        d_ff=p.ffn_hidden_size, num_layers=layers, num_decoder_layers=p.num_layers, num_heads=p.num_attention_heads,
        relative_attention_num_buckets=p.relative_attention_num_buckets,
        relative_attention_max_distance=p.relative_attention_max_distance, layer_norm_epsilon=p.layernorm_epsilon,
        dropout_rate=float(p.hidden_dropout), feed_forward_proj=("gated-" if p.gated_linear_unit else "") + act,
        tie_word_embeddings=bool(p.share_embeddings_and_output_weights),
        scale_decoder_outputs=bool(p.scale_decoder_outputs), is_encoder_decoder=True,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )


def _mt5_provider(cfg: dict[str, Any]) -> dict[str, Any]:
    return dict(_t5_provider(cfg), scale_decoder_outputs=False)  # mT5 never scales its decoder output


def _mt5_hf(p: Any) -> dict[str, Any]:
    if p.scale_decoder_outputs:
        raise NotSupportedError("mT5 has no decoder output scaling: export a model with scale_decoder_outputs as T5")
    out = _t5_hf(p)
    out.pop("scale_decoder_outputs")
    return out


def _t5_weights(cfg: dict[str, Any]) -> tuple[mapping.WeightMap, ...]:
    return mapping.T5 if _t5_feed_forward(cfg)[0] else mapping.T5_UNGATED


def _mamba_mixer_fields(cfg: dict[str, Any], heads_key: str, head_dim_key: str, state_key: str, act_key: str,
                       limit: tuple[float, float] | None) -> dict[str, Any]:
    """MambaProvider fields of a Mamba-2 mixer's config.json keys (shared by Mamba2 and Nemotron-H)."""
    if cfg.get(act_key, "silu") != "silu":
        raise NotSupportedError(f"config.json {act_key}={cfg[act_key]!r} is not supported: longspan's Mamba uses silu")
    for key, default in (("use_conv_bias", True), ("use_bias", False), ("mamba_proj_bias", False)):
        if key in cfg and bool(cfg[key]) != default:
            raise NotSupportedError(f"config.json {key}={cfg[key]!r} is not supported: longspan needs {default}")
    # transformers writes infinity as {"__float__": "Infinity"}
    got = tuple(float(x["__float__"] if isinstance(x, dict) else x)
                for x in (cfg.get("time_step_limit") or (0.0, float("inf"))))
    if limit is not None and got != limit:
        raise NotSupportedError(f"config.json time_step_limit={list(got)} is not supported: longspan needs {list(limit)}")
    return dict(
        mamba_num_heads=_need(cfg, heads_key),
        mamba_head_dim=_need(cfg, head_dim_key),
        mamba_state_dim=_need(cfg, state_key),
        mamba_num_groups=int(cfg.get("n_groups", 8)),
        mamba_conv_kernel=int(cfg.get("conv_kernel", 4)),
        mamba_chunk_size=int(cfg.get("chunk_size", 256)),
    )


def _mamba_mixer_hf(p: Any) -> dict[str, Any]:
    heads = p.mamba_num_heads or p.mamba_expand * p.hidden_size // p.mamba_head_dim
    return dict(n_groups=p.mamba_num_groups, conv_kernel=p.mamba_conv_kernel, chunk_size=p.mamba_chunk_size,
                use_conv_bias=True, use_bias=False, heads=heads)


def _mamba2_provider(cfg: dict[str, Any]) -> dict[str, Any]:
    layers = _need(cfg, "num_hidden_layers")
    vocab = _need(cfg, "vocab_size")
    if cfg.get("hidden_size", 0) * cfg.get("expand", 2) != cfg.get("num_heads", 0) * cfg.get("head_dim", 0):
        raise ConfigError("config.json hidden_size × expand must equal num_heads × head_dim (transformers' own rule)")
    out = dict(
        num_layers=layers,
        hybrid_override_pattern="M" * layers,
        hidden_size=_need(cfg, "hidden_size"),
        mamba_expand=int(cfg.get("expand", 2)),
        vocab_size=vocab,
        make_vocab_size_divisible_by=vocab_divisor(vocab),
        normalization="RMSNorm",
        layernorm_epsilon=float(cfg.get("layer_norm_epsilon", 1e-5)),
        position_embedding_type="none",
        share_embeddings_and_output_weights=bool(cfg.get("tie_word_embeddings", False)),
        hidden_dropout=0.0,
        init_method_std=float(cfg.get("initializer_range", 0.1)),
    )
    out.update(_mamba_mixer_fields(cfg, "num_heads", "head_dim", "state_size", "hidden_act", (0.0, float("inf"))))
    out.update(_dtype_fields(cfg))
    return out


def _mamba2_hf(p: Any) -> dict[str, Any]:
    pattern = p.hybrid_override_pattern
    if (pattern is not None and set(pattern) != {"M"}) or p.hybrid_attention_ratio or p.hybrid_mlp_ratio:
        raise NotSupportedError("Mamba2ForCausalLM has Mamba layers only: export a hybrid model as NemotronH")
    if p.normalization != "RMSNorm":
        raise NotSupportedError("Mamba2ForCausalLM needs normalization='RMSNorm'")
    mixer = _mamba_mixer_hf(p)
    heads = mixer.pop("heads")
    if heads * p.mamba_head_dim % p.hidden_size:
        raise NotSupportedError("Mamba2ForCausalLM needs d_inner (heads × head_dim) to be a multiple of hidden_size")
    return dict(
        vocab_size=p.vocab_size, hidden_size=p.hidden_size, num_hidden_layers=p.num_layers, num_heads=heads,
        head_dim=p.mamba_head_dim, state_size=p.mamba_state_dim, expand=heads * p.mamba_head_dim // p.hidden_size,
        layer_norm_epsilon=p.layernorm_epsilon, hidden_act="silu", residual_in_fp32=True, initializer_range=float(p.init_method_std),
        tie_word_embeddings=bool(p.share_embeddings_and_output_weights), **mixer,
    )


_NEMOTRON_H_SYMBOLS = {"linear_attention": "M", "mamba": "M", "full_attention": "*", "attention": "*", "mlp": "-",
                       "moe": "E"}
_NEMOTRON_H_TYPES = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}


def _nemotron_h_provider(cfg: dict[str, Any]) -> dict[str, Any]:
    types = cfg.get("layers_block_type")
    if types:
        unknown = sorted(set(types) - set(_NEMOTRON_H_SYMBOLS))
        if unknown:
            raise NotSupportedError(f"config.json layers_block_type has {unknown}: longspan reads {sorted(_NEMOTRON_H_SYMBOLS)}")
        pattern = "".join(_NEMOTRON_H_SYMBOLS[t] for t in types)
    else:
        pattern = _need(cfg, "hybrid_override_pattern")
    if "E" in pattern:
        raise NotSupportedError("config.json: Nemotron-H MoE layers ('moe' / 'E') are not supported yet by longspan")
    for key in ("attention_bias", "mlp_bias", "sliding_window"):
        if cfg.get(key):
            raise NotSupportedError(f"config.json {key}={cfg[key]!r} is not supported for Nemotron-H")
    if cfg.get("num_nextn_predict_layers"):
        raise NotSupportedError("config.json num_nextn_predict_layers > 0 (multi-token prediction) is not supported")
    if cfg.get("mlp_hidden_act", "relu2") != "relu2":
        raise NotSupportedError(f"config.json mlp_hidden_act={cfg['mlp_hidden_act']!r} is not supported: use relu2")
    vocab = _need(cfg, "vocab_size")
    heads = _need(cfg, "num_attention_heads")
    out = dict(
        num_layers=len(pattern),
        hybrid_override_pattern=pattern,
        hidden_size=_need(cfg, "hidden_size"),
        num_attention_heads=heads,
        num_query_groups=cfg.get("num_key_value_heads") or heads,
        kv_channels=cfg.get("head_dim") or _need(cfg, "hidden_size") // heads,
        ffn_hidden_size=_need(cfg, "intermediate_size"),
        activation_func=squared_relu,
        gated_linear_unit=False,
        add_bias_linear=False,
        seq_length=int(cfg.get("max_position_embeddings", 4096)),
        vocab_size=vocab,
        make_vocab_size_divisible_by=vocab_divisor(vocab),
        normalization="RMSNorm",
        layernorm_epsilon=float(cfg.get("layer_norm_epsilon", 1e-5)),
        position_embedding_type="none",
        share_embeddings_and_output_weights=bool(cfg.get("tie_word_embeddings", False)),
        attention_dropout=float(cfg.get("attention_dropout", 0.0)),
        hidden_dropout=float(cfg.get("hidden_dropout", 0.0)),
        init_method_std=float(cfg.get("initializer_range", 0.02)),
        # transformers' Nemotron-H clamps softplus(dt) at time_step_min (its time_step_limit field is unused)
        mamba_dt_limit_min=float(cfg.get("time_step_min", 0.001)),
    )
    out.update(_mamba_mixer_fields(cfg, "mamba_num_heads", "mamba_head_dim", "ssm_state_size", "mamba_hidden_act",
                                   None))
    out.update(_dtype_fields(cfg))
    return out


def _nemotron_h_hf(p: Any) -> dict[str, Any]:
    from longspan.models.mamba import allocate_layers

    pattern = "".join(allocate_layers(p.num_layers, p.hybrid_attention_ratio, p.hybrid_mlp_ratio,
                                      p.hybrid_override_pattern))
    if "E" in pattern or p.normalization != "RMSNorm" or p.add_bias_linear or p.gated_linear_unit:
        raise NotSupportedError("Nemotron-H needs RMSNorm, no MoE layers, no linear biases and a plain MLP")
    if "-" in pattern and p.activation_func is not squared_relu:
        raise NotSupportedError("Nemotron-H's MLP layers use squared ReLU: set activation_func to squared_relu")
    if p.position_embedding_type != "none":
        raise NotSupportedError("Nemotron-H attention has no position embedding: set position_embedding_type='none'")
    mixer = _mamba_mixer_hf(p)
    heads = mixer.pop("heads")
    return dict(
        vocab_size=p.vocab_size, hidden_size=p.hidden_size, layers_block_type=[_NEMOTRON_H_TYPES[c] for c in pattern],
        num_attention_heads=p.num_attention_heads, num_key_value_heads=p.num_query_groups or p.num_attention_heads,
        head_dim=p.kv_channels or p.hidden_size // p.num_attention_heads, intermediate_size=p.ffn_hidden_size,
        mlp_hidden_act="relu2", max_position_embeddings=p.seq_length, mamba_num_heads=heads,
        mamba_head_dim=p.mamba_head_dim, ssm_state_size=p.mamba_state_dim, mamba_hidden_act="silu",
        time_step_min=float(p.mamba_dt_limit_min), mamba_proj_bias=False, attention_bias=False, mlp_bias=False,
        layer_norm_epsilon=p.layernorm_epsilon, residual_in_fp32=False,
        tie_word_embeddings=bool(p.share_embeddings_and_output_weights), attention_dropout=float(p.attention_dropout),
        hidden_dropout=float(p.hidden_dropout), initializer_range=float(p.init_method_std), **mixer,
    )


class _ProviderView:
    """A provider with a few fields replaced (read-only)."""

    def __init__(self, provider: Any, **changes: Any) -> None:
        self._provider, self._changes = provider, changes

    def __getattr__(self, name: str) -> Any:
        return self._changes[name] if name in self._changes else getattr(self._provider, name)


FAMILIES: tuple[Family, ...] = (
    Family("llama", "LlamaForCausalLM", "llama", mapping.LLAMA, _llama_provider, _llama_hf),
    Family("mistral", "MistralForCausalLM", "mistral", mapping.LLAMA, _mistral_provider, _mistral_hf),
    Family("qwen2", "Qwen2ForCausalLM", "qwen2", mapping.LLAMA, _qwen2_provider, _qwen2_hf),
    Family("qwen3", "Qwen3ForCausalLM", "qwen3", mapping.LLAMA, _qwen3_provider, _qwen3_hf),
    Family("gpt2", "GPT2LMHeadModel", "gpt2", mapping.GPT2, _gpt2_provider, _gpt2_hf),
    Family("mixtral", "MixtralForCausalLM", "mixtral", mapping.MIXTRAL, _mixtral_provider, _mixtral_hf),
    Family("qwen3_moe", "Qwen3MoeForCausalLM", "qwen3_moe", mapping.QWEN3_MOE, _qwen3_moe_provider, _qwen3_moe_hf),
    Family("t5", "T5ForConditionalGeneration", "t5", mapping.T5, _t5_provider, _t5_hf, "T5ModelProvider", _t5_weights),
    Family("mt5", "MT5ForConditionalGeneration", "mt5", mapping.T5, _mt5_provider, _mt5_hf, "T5ModelProvider",
           _t5_weights),
    Family("mamba2", "Mamba2ForCausalLM", "mamba2", mapping.MAMBA2, _mamba2_provider, _mamba2_hf, "MambaProvider"),
    Family("nemotron_h", "NemotronHForCausalLM", "nemotron_h", mapping.NEMOTRON_H, _nemotron_h_provider,
           _nemotron_h_hf, "MambaProvider"),
)

BY_ARCHITECTURE = {f.architecture: f for f in FAMILIES}


def supported_architectures() -> list[str]:
    """The HF ``architectures`` names longspan converts."""
    return [f.architecture for f in FAMILIES]


def family_for_config(cfg: dict[str, Any]) -> Family:
    """The family of a config.json dict, from its ``architectures`` entry (or ``model_type``)."""
    archs = cfg.get("architectures") or []
    for arch in archs:
        if arch in BY_ARCHITECTURE:
            return BY_ARCHITECTURE[arch]
    if not archs:
        for family in FAMILIES:
            if family.model_type == cfg.get("model_type"):
                return family
    named = ", ".join(archs) if archs else f"model_type={cfg.get('model_type')!r}"
    raise NotSupportedError(
        f"HF architecture {named} is not supported: longspan converts {', '.join(supported_architectures())}"
    )


def family_for_provider(provider: Any) -> Family:
    """The HF architecture a longspan model exports as (for checkpoints that were not imported from HF)."""
    if type(provider).__name__ == "T5ModelProvider":
        return BY_ARCHITECTURE["T5ForConditionalGeneration"]
    if type(provider).__name__ == "MambaProvider":
        pattern = provider.hybrid_override_pattern
        pure = (set(pattern) == {"M"}) if pattern else not (provider.hybrid_attention_ratio or provider.hybrid_mlp_ratio)
        return BY_ARCHITECTURE["Mamba2ForCausalLM" if pure else "NemotronHForCausalLM"]
    if provider.position_embedding_type == "learned_absolute":
        return BY_ARCHITECTURE["GPT2LMHeadModel"]
    if provider.num_moe_experts:
        return BY_ARCHITECTURE["Qwen3MoeForCausalLM" if provider.qk_layernorm else "MixtralForCausalLM"]
    if provider.qk_layernorm:
        return BY_ARCHITECTURE["Qwen3ForCausalLM"]
    if provider.add_qkv_bias and not provider.add_bias_linear:
        return BY_ARCHITECTURE["Qwen2ForCausalLM"]
    return BY_ARCHITECTURE["LlamaForCausalLM"]


def hf_config_dict(family: Family, provider: Any) -> dict[str, Any]:
    """A complete config.json dict for ``provider`` exported as ``family``."""
    body = family.to_hf(provider)
    dtype = provider.params_dtype or torch.float32
    return {"architectures": [family.architecture], "model_type": family.model_type, **body,
            "dtype": _DTYPE_NAMES.get(dtype, "float32")}
