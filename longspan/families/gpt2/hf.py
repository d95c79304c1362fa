"""GPT-2 (``GPT2LMHeadModel``): LayerNorm, learned absolute positions, a plain GeLU MLP and biases everywhere,
as config.json and weights (HF's ``Conv1D`` matrices are stored ``[in, out]``)."""

from __future__ import annotations

from typing import Any

from longspan.conversion.config_fields import HF_ACTIVATIONS, dtype_fields, hf_activation, vocab_divisor
from longspan.conversion.decoder_fields import no_window
from longspan.conversion.families import Family
from longspan.conversion.hf_fields import HFField, export_fields, import_fields
from longspan.conversion.mapping import WeightMap
from longspan.core.errors import NotSupportedError


def _block(ours: str, hf: str, **kw: Any) -> WeightMap:
    return WeightMap(f"decoder.layers.{{i}}.{ours}", f"transformer.h.{{i}}.{hf}", **kw)


WEIGHTS = (
    WeightMap("embedding.word_embeddings.weight", "transformer.wte.weight", vocab=True),
    WeightMap("embedding.position_embeddings.weight", "transformer.wpe.weight"),
    WeightMap("decoder.final_layernorm.weight", "transformer.ln_f.weight"),
    WeightMap("decoder.final_layernorm.bias", "transformer.ln_f.bias"),
    WeightMap("output_layer.weight", "lm_head.weight", vocab=True),
    _block("input_layernorm.weight", "ln_1.weight"),
    _block("input_layernorm.bias", "ln_1.bias"),
    _block("pre_mlp_layernorm.weight", "ln_2.weight"),
    _block("pre_mlp_layernorm.bias", "ln_2.bias"),
    # c_attn is a Conv1D [hidden, 3*hidden] holding [q | k | v] along its output dim.
    _block("self_attention.linear_q.weight", "attn.c_attn.weight", transpose=True, split=(0, 3)),
    _block("self_attention.linear_k.weight", "attn.c_attn.weight", transpose=True, split=(1, 3)),
    _block("self_attention.linear_v.weight", "attn.c_attn.weight", transpose=True, split=(2, 3)),
    _block("self_attention.linear_q.bias", "attn.c_attn.bias", split=(0, 3)),
    _block("self_attention.linear_k.bias", "attn.c_attn.bias", split=(1, 3)),
    _block("self_attention.linear_v.bias", "attn.c_attn.bias", split=(2, 3)),
    _block("self_attention.linear_proj.weight", "attn.c_proj.weight", transpose=True),
    _block("self_attention.linear_proj.bias", "attn.c_proj.bias"),
    _block("mlp.linear_fc1.weight", "mlp.c_fc.weight", transpose=True),
    _block("mlp.linear_fc1.bias", "mlp.c_fc.bias"),
    _block("mlp.linear_fc2.weight", "mlp.c_proj.weight", transpose=True),
    _block("mlp.linear_fc2.bias", "mlp.c_proj.bias"),
)

# config.json keys <-> provider fields read on import (in the provider's keyword order).
_SHAPE = (
    HFField("n_layer", "num_layers"),
    HFField("n_embd", "hidden_size"),
    HFField("n_inner", "ffn_hidden_size", default=lambda cfg: 4 * cfg["n_embd"], falsy_default=True),
    HFField("n_head", "num_attention_heads"),
    HFField("n_positions", "seq_length"),
    HFField("vocab_size", "vocab_size"),
)
_REST = (
    HFField("layer_norm_epsilon", "layernorm_epsilon", default=1e-5, to_ours=float),
)
_TAIL = (
    HFField("tie_word_embeddings", "share_embeddings_and_output_weights", default=True, to_ours=bool),
    HFField("attn_pdrop", "attention_dropout", default=0.1, to_ours=float),
    HFField("resid_pdrop", "hidden_dropout", default=0.1, to_ours=float),
    HFField("initializer_range", "init_method_std", default=0.02, to_ours=float),
)


def gpt2_provider(cfg: dict[str, Any]) -> dict[str, Any]:
    """Provider keyword arguments of a GPT-2 config.json."""
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
    out = import_fields(_SHAPE, cfg)
    out["make_vocab_size_divisible_by"] = vocab_divisor(out["vocab_size"])
    out["normalization"] = "LayerNorm"
    out.update(import_fields(_REST, cfg))
    out.update(position_embedding_type="learned_absolute", gated_linear_unit=False,
               activation_func=HF_ACTIVATIONS[act], add_bias_linear=True, add_qkv_bias=False)
    out.update(import_fields(_TAIL, cfg))
    out.update(dtype_fields(cfg))
    return out


def gpt2_hf(p: Any) -> dict[str, Any]:
    """A GPT-2 config.json body for provider ``p``."""
    if p.normalization != "LayerNorm" or p.position_embedding_type != "learned_absolute" or p.gated_linear_unit:
        raise NotSupportedError("GPT-2 needs LayerNorm, learned absolute positions and a plain gelu MLP")
    no_window(p, "GPT-2")
    shape = export_fields(_SHAPE, p)
    dropout = float(p.hidden_dropout)
    return dict(
        vocab_size=shape["vocab_size"], n_positions=shape["n_positions"], n_embd=shape["n_embd"],
        n_layer=shape["n_layer"], n_head=shape["n_head"], n_inner=shape["n_inner"],
        activation_function=hf_activation(p), layer_norm_epsilon=p.layernorm_epsilon, resid_pdrop=dropout,
        embd_pdrop=dropout, attn_pdrop=float(p.attention_dropout), initializer_range=float(p.init_method_std),
        tie_word_embeddings=bool(p.share_embeddings_and_output_weights),
    )


GPT2 = Family("gpt2", "GPT2LMHeadModel", "gpt2", WEIGHTS, gpt2_provider, gpt2_hf, tie_word_embeddings_default=True)
