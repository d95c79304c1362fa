"""OLMo-2 (``Olmo2ForCausalLM``) as config.json and weights: plain RMSNorm only after attention and the MLP
(``x + norm(attn(x))``) and a QK-norm over each token's whole query / key projection."""

from __future__ import annotations

from typing import Any

from longspan.conversion.config_fields import hf_activation, rope_fields, rope_hf
from longspan.conversion.decoder_fields import activation_func, decoder_shape, decoder_shape_hf
from longspan.conversion.families import Family
from longspan.conversion.mapping import DECODER_EMBEDDINGS, DECODER_MLP, DECODER_QKVO, POST_SUBLAYER_NORMS
from longspan.core.errors import NotSupportedError

# No pre-norms; q_norm / k_norm span the whole projections.
OLMO2_WEIGHTS = DECODER_EMBEDDINGS + DECODER_QKVO + POST_SUBLAYER_NORMS + DECODER_MLP[:3]


def olmo2_provider(cfg: dict[str, Any]) -> dict[str, Any]:
    """Provider keyword arguments of an OLMo-2 config.json."""
    out = decoder_shape(cfg, eps_default=1e-5)
    out.update(
        activation_func=activation_func(cfg, "hidden_act", "silu"),
        share_embeddings_and_output_weights=bool(cfg.get("tie_word_embeddings", False)),
        layernorm_before_sublayers=False,
        layernorm_after_sublayers=True,
        qk_layernorm=True,
        qk_layernorm_across_heads=True,
    )
    out.update(rope_fields(cfg))
    return out


def olmo2_hf(p: Any) -> dict[str, Any]:
    """An OLMo-2 config.json body for provider ``p``."""
    ok = (p.normalization == "RMSNorm" and not p.layernorm_before_sublayers and p.layernorm_after_sublayers
          and p.qk_layernorm and p.qk_layernorm_across_heads and not p.layernorm_zero_centered_gamma
          and not p.apply_embedding_scaling and p.gated_linear_unit and not p.add_bias_linear
          and not p.add_qkv_bias and p.position_embedding_type == "rope" and hf_activation(p) is not None)
    if not ok:
        raise NotSupportedError(
            "this model has no OLMo-2 equivalent (needs RMSNorm only after attention and the MLP, QK-norm across "
            "heads, RoPE, a gated MLP and no biases)"
        )
    out = decoder_shape_hf(p)
    out.update(hidden_act=hf_activation(p))
    out.update(rope_hf(p))
    return out


OLMO2 = Family("olmo2", "Olmo2ForCausalLM", "olmo2", OLMO2_WEIGHTS, olmo2_provider, olmo2_hf)
