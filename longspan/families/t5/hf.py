"""T5 and mT5 (``T5ForConditionalGeneration``, ``MT5ForConditionalGeneration``): the encoder-decoder model kind,
as config.json and weights."""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F

from longspan.config.rules.sliding_window import two_sided_window
from longspan.conversion.config_fields import dtype_fields, required, vocab_divisor
from longspan.conversion.families import Family
from longspan.conversion.mapping import WeightMap
from longspan.core.errors import NotSupportedError
from longspan.models.activations import gelu_tanh
from longspan.models.t5_provider import T5ModelProvider


def _t5(stack: str, ours: str, hf: str) -> WeightMap:
    return WeightMap(f"{stack}.layers.{{i}}.{ours}", f"{stack}.block.{{i}}.layer.{hf}")


def _t5_mlp(stack: str, sub: int) -> tuple[WeightMap, ...]:
    # v1.0: wi (relu); v1.1 / mT5 gated-gelu: wi_0 (gate) and wi_1 (up); longspan's linear_fc1_gate / linear_fc1.
    return (
        _t5(stack, "pre_mlp_layernorm.weight", f"{sub}.layer_norm.weight"),
        _t5(stack, "mlp.linear_fc1_gate.weight", f"{sub}.DenseReluDense.wi_0.weight"),
        _t5(stack, "mlp.linear_fc1.weight", f"{sub}.DenseReluDense.wi_1.weight"),
        _t5(stack, "mlp.linear_fc2.weight", f"{sub}.DenseReluDense.wo.weight"),
    )


def _t5_attention(stack: str, ours: str, sub: int, hf: str, norm: str) -> tuple[WeightMap, ...]:
    return (
        _t5(stack, f"{norm}.weight", f"{sub}.layer_norm.weight"),
        *(_t5(stack, f"{ours}.linear_{a}.weight", f"{sub}.{hf}.{b}.weight") for a, b in
          (("q", "q"), ("k", "k"), ("v", "v"), ("proj", "o"))),
    )


T5 = (
    WeightMap("embedding.word_embeddings.weight", "shared.weight", vocab=True),
    WeightMap("output_layer.weight", "lm_head.weight", vocab=True),
    # T5 computes the relative bias in the first layer of each stack and shares it with the others.
    WeightMap("encoder_relative_pos_emb.relative_attention_bias.weight",
              "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"),
    WeightMap("decoder_relative_pos_emb.relative_attention_bias.weight",
              "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"),
    WeightMap("encoder.final_layernorm.weight", "encoder.final_layer_norm.weight"),
    WeightMap("decoder.final_layernorm.weight", "decoder.final_layer_norm.weight"),
    *_t5_attention("encoder", "self_attention", 0, "SelfAttention", "input_layernorm"),
    *_t5_mlp("encoder", 1),
    *_t5_attention("decoder", "self_attention", 0, "SelfAttention", "input_layernorm"),
    *_t5_attention("decoder", "cross_attention", 1, "EncDecAttention", "pre_cross_attn_layernorm"),
    *_t5_mlp("decoder", 2),
)

# Ungated (v1.0, relu) T5: the MLP's single input projection is wi.
T5_UNGATED = tuple(
    WeightMap(e.ours, e.hf.replace("DenseReluDense.wi_1.", "DenseReluDense.wi.")) for e in T5
    if "DenseReluDense.wi_0." not in e.hf
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


def t5_provider(cfg: dict[str, Any]) -> dict[str, Any]:
    """T5ModelProvider keyword arguments of a T5 config.json."""
    gated, act = _t5_feed_forward(cfg)
    vocab = required(cfg, "vocab_size")
    layers = required(cfg, "num_layers")
    # transformers 5 writes scale_decoder_outputs; older configs scale exactly when the embeddings are tied.
    scale = cfg.get("scale_decoder_outputs", cfg.get("tie_word_embeddings", True) is not False)
    out = dict(
        num_layers=cfg.get("num_decoder_layers") or layers,
        encoder_num_layers=layers,
        hidden_size=required(cfg, "d_model"),
        ffn_hidden_size=required(cfg, "d_ff"),
        num_attention_heads=required(cfg, "num_heads"),
        kv_channels=required(cfg, "d_kv"),
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
    out.update(dtype_fields(cfg))
    return out


def t5_hf(p: Any) -> dict[str, Any]:
    """A T5 config.json body for provider ``p``."""
    if two_sided_window(p) is not None:
        raise NotSupportedError("HF T5 attends fully: export a model without window_size")
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


def mt5_provider(cfg: dict[str, Any]) -> dict[str, Any]:
    """T5ModelProvider keyword arguments of an mT5 config.json."""
    return dict(t5_provider(cfg), scale_decoder_outputs=False)  # mT5 never scales its decoder output


def mt5_hf(p: Any) -> dict[str, Any]:
    """An mT5 config.json body for provider ``p`` (no decoder output scaling)."""
    if p.scale_decoder_outputs:
        raise NotSupportedError("mT5 has no decoder output scaling: export a model with scale_decoder_outputs as T5")
    out = t5_hf(p)
    out.pop("scale_decoder_outputs")
    return out


def t5_weights(cfg: dict[str, Any]) -> tuple[WeightMap, ...]:
    """T5's table for config.json ``cfg``: gated (v1.1, mT5) or plain (v1.0) MLP."""
    return T5 if _t5_feed_forward(cfg)[0] else T5_UNGATED


T5_FAMILY = Family("t5", "T5ForConditionalGeneration", "t5", T5, t5_provider, t5_hf, T5ModelProvider, t5_weights)
MT5_FAMILY = Family("mt5", "MT5ForConditionalGeneration", "mt5", T5, mt5_provider, mt5_hf, T5ModelProvider,
                    t5_weights)
