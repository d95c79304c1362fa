"""Config rules of the model section: what longspan's GPT (dense and MoE), Mamba/hybrid and T5 models can
build. ``validate()`` runs :func:`check_model` with the other rules; the models run the same checks when a
provider is used on its own (``provider.provide()``), then derive their typed arguments (``models/args.py``).

The rules read the provider's fields by name only (this package sits below ``models``): a provider is
recognised by the fields it has, not by its class.
"""

from __future__ import annotations

import copy
from typing import Any

from longspan.config.rules.linear_attention import check_linear_attention
from longspan.config.rules.mla import check_mla, check_no_mla_fields
from longspan.config.rules.moe import check_moe
from longspan.config.rules.sliding_window import check_causal_window, check_stack_windows
from longspan.core.errors import ConfigError, NotSupportedError

# TransformerConfig fields that no longspan model implements at other values yet (GPT, Mamba's attention
# layers and T5 each add their own to these): none left; the per-model tables below hold the rest.
TRANSFORMER_FIXED_FIELDS: dict[str, Any] = {}

# Multi-latent attention is built by the GPT model's layers only.
MLA_FIXED_FIELDS: dict[str, Any] = {"multi_latent_attention": False}

# The residual-stream fields the GPT layer implements but the Mamba/hybrid and T5 layers do not.
RESIDUAL_FIXED_FIELDS: dict[str, Any] = {
    "apply_residual_connection_post_layernorm": False,
    "fp32_residual_connection": False,
}

# TransformerConfig / GPTModelProvider fields (when the provider has them) that the GPT model implements only
# at these values. Pure kernel choices (fusions, TransformerEngine switches) change no maths and are accepted;
# fp8 is applied from outside (longspan.parallel.float8), not by the model.
GPT_FIXED_FIELDS: dict[str, Any] = {
    **TRANSFORMER_FIXED_FIELDS,
}

T5_FIXED_FIELDS: dict[str, Any] = {
    **TRANSFORMER_FIXED_FIELDS,
    **MLA_FIXED_FIELDS,
    "mtp_num_layers": None,
    "num_moe_experts": None,
    "fp8": None,
    "expert_model_parallel_size": 1,
}


# Why each T5ModelProvider field that stays "not supported" does (keys "ClassName.field", the form of
# longspan.config.support's per-class reasons); the model's one-line errors end with them.
_T5_MOE = "Megatron's T5 layer specs have no MoE layers"
T5_NOT_SUPPORTED_REASONS: dict[str, str] = {
    "T5ModelProvider.num_moe_experts": _T5_MOE,
    "T5ModelProvider.expert_model_parallel_size": _T5_MOE,
    "T5ModelProvider.expert_tensor_parallel_size": _T5_MOE,
    "T5ModelProvider.multi_latent_attention": "multi-latent attention is a GPT attention; T5 uses multi-head",
    "T5ModelProvider.mtp_num_layers": "multi-token prediction is a GPT head; T5 has none",
    "T5ModelProvider.mtp_loss_scaling_factor": "multi-token prediction is a GPT head; T5 has none",
}


def check_fixed_fields(config: Any, fixed_fields: dict[str, Any], model: str,
                       reasons: dict[str, str] | None = None) -> None:
    """Raise ``NotSupportedError`` for the first of ``fixed_fields`` (name -> the one value the model implements)
    that ``config`` sets to another value; a missing field counts as supported, and a falsy value as ``False``.
    ``model`` ends the error's "is not supported ..." phrase (e.g. "by longspan's GPT model"); ``reasons``
    (keyed "ClassName.field") add why, for ``config``'s class."""
    for field, supported in fixed_fields.items():
        value = getattr(config, field, supported)
        if value != supported and not (supported is False and not value):
            reason = (reasons or {}).get(f"{type(config).__name__}.{field}")
            why = f" ({reason})" if reason else ""
            raise NotSupportedError(
                f"model.{field}={value!r} is not supported {model}{why}: leave it at {supported!r}")


def head_dim(config: Any) -> int:
    """``kv_channels``, or hidden_size / num_attention_heads (Megatron's default)."""
    return config.kv_channels or config.hidden_size // config.num_attention_heads


def provider_field(config: Any, name: str, default: Any) -> Any:
    """``config.<name>`` for a field that only some provider classes declare (GPTModelProvider's and the
    vision-language providers' ``softmax_type``, ``rope_scaling``, ``mrope_section``, ...; MambaProvider runs
    the GPT checks for its attention layers without them), else ``default``: the value the model builds for a
    provider without the field. Fields every provider has (TransformerConfig's) are read directly."""
    return getattr(config, name, default)  # getattr: declared by some provider classes only (see above)


def check_model(cfg: Any) -> None:
    """The rule ``validate()`` runs: the model section's checks for the kind of provider it holds."""
    config = cfg.model
    if is_t5_provider(config):
        check_t5_model(config)
    elif is_mamba_provider(config):
        check_mamba_model(config)
    elif config.position_embedding_type == "mrope":
        check_mrope_model(config)
    else:
        check_gpt_model(config)


def check_mrope_model(config: Any) -> None:
    """A multimodal-RoPE model (a vision-language model's): its mRoPE fields, then its language model's GPT checks (as plain
    RoPE, which mRoPE extends)."""
    sections = provider_field(config, "mrope_section", None)
    if sections is None:
        raise NotSupportedError("model.position_embedding_type='mrope' needs a vision-language provider with "
                                "mrope_section: use 'rope' for a text-only model")
    # an interleaved table (Qwen3-VL, Qwen3.5) gives every pair of the rotating part (rotary_percent of each
    # head) an axis by its index, whatever the sections sum to; a sectioned one needs them to cover the head
    interleaved = bool(provider_field(config, "mrope_interleaved", False))
    half = head_dim(config) // 2
    if (not isinstance(sections, (list, tuple)) or len(sections) != 3
            or not all(isinstance(n, int) and n >= 0 for n in sections)
            or (sum(sections) != half and not interleaved)):
        raise ConfigError(f"model.mrope_section={sections!r} must be 3 counts of rotary frequency pairs "
                          f"(temporal, height, width) summing to kv_channels / 2 = {half}")
    # The mRoPE table is one plain table over kv_channels: no other scaling, local base or latent attention.
    plain_fields = ((() if interleaved else (("rotary_percent", 1.0),)) + (
        ("seq_len_interpolation_factor", None), ("rope_scaling", False), ("rope_dynamic_factor", None),
        ("rope_longrope_short_factor", None), ("multi_latent_attention", False)))
    for name, plain in plain_fields:
        if getattr(config, name, plain) != plain:
            raise NotSupportedError(f"model.{name}={getattr(config, name)!r} is not supported with mRoPE: "
                                    f"leave it at {plain!r}")
    if isinstance(config.rotary_base, (list, tuple)):
        raise NotSupportedError(f"model.rotary_base={list(config.rotary_base)!r} (a [local, global] pair) is not "
                                "supported with mRoPE: give one number")
    text = copy.copy(config)
    text.position_embedding_type = "rope"
    check_gpt_model(text)


def is_t5_provider(config: Any) -> bool:
    """A T5 provider: it has an encoder depth and a decoder sequence length."""
    return hasattr(config, "encoder_num_layers") and hasattr(config, "seq_length_dec")


def is_mamba_provider(config: Any) -> bool:
    """A Mamba/hybrid provider: it has the Mamba state size and the hybrid layer pattern."""
    return hasattr(config, "mamba_state_dim") and hasattr(config, "hybrid_override_pattern")


def check_gpt_model(config: Any, fixed_fields: dict[str, Any] = GPT_FIXED_FIELDS) -> None:
    """The GPT model's checks (dense and MoE): one-line ``NotSupportedError`` / ``ConfigError`` naming the field,
    the value and what is valid. Mamba's attention layers run them with ``TRANSFORMER_FIXED_FIELDS``."""
    check_fixed_fields(config, fixed_fields, "by longspan's GPT model")
    if config.normalization not in ("LayerNorm", "RMSNorm"):
        raise NotSupportedError(
            f"model.normalization={config.normalization!r} is not supported: use 'LayerNorm' or 'RMSNorm'"
        )
    if config.position_embedding_type not in ("rope", "yarn", "learned_absolute", "none"):
        raise NotSupportedError(
            f"model.position_embedding_type={config.position_embedding_type!r} is not supported: "
            "use 'rope', 'yarn', 'learned_absolute' or 'none'"
        )
    if not callable(config.activation_func):
        raise ConfigError(f"model.activation_func={config.activation_func!r} is not callable: use F.gelu or F.silu")
    if config.num_layers <= 0 or config.hidden_size <= 0:
        raise ConfigError(
            f"model.num_layers={config.num_layers} and model.hidden_size={config.hidden_size} must be positive"
        )
    if config.multi_latent_attention:
        check_mla(config)
    else:
        check_no_mla_fields(config)
        _check_heads(config)
        if config.position_embedding_type in ("rope", "yarn"):
            _check_rotary(config)
    if config.position_embedding_type in ("rope", "yarn"):
        check_rope_scaling(config)
    if not config.attention_softmax_in_fp32 and config.context_parallel_size > 1:
        raise NotSupportedError(
            "model.attention_softmax_in_fp32=False is not supported with context_parallel_size > 1 (context "
            "parallel attention always accumulates in fp32): leave it True"
        )
    _check_norms_and_caps(config)
    _check_recompute(config)
    check_causal_window(config)
    check_moe(config)
    check_sink_and_glu_fields(config)
    check_linear_attention(config)
    check_mtp(config)


def check_sink_and_glu_fields(config: Any) -> None:
    """Attention sinks (``softmax_type``) and the gated MLP's ``glu_linear_offset`` /
    ``activation_func_clamp_value``: valid values and the combinations longspan implements."""
    softmax_type = provider_field(config, "softmax_type", "vanilla")
    if softmax_type not in ("vanilla", "off-by-one", "learnable"):
        raise ConfigError(f"model.softmax_type={softmax_type!r}: use 'vanilla', 'off-by-one' or 'learnable'")
    if softmax_type != "vanilla":
        if config.context_parallel_size > 1:
            raise NotSupportedError(f"model.softmax_type={softmax_type!r} is not supported with "
                                    "context_parallel_size > 1: use 'vanilla' or context_parallel_size=1")
        if provider_field(config, "attn_logit_softcapping", None):
            raise NotSupportedError(f"model.softmax_type={softmax_type!r} is not supported with "
                                    "attn_logit_softcapping: use one of them")
    offset = provider_field(config, "glu_linear_offset", 0.0)
    clamp = provider_field(config, "activation_func_clamp_value", None)
    if (offset or clamp is not None) and not config.gated_linear_unit:
        raise ConfigError(f"model.glu_linear_offset={offset!r} / model.activation_func_clamp_value={clamp!r} need "
                          "gated_linear_unit=True (they act on a gated MLP's gate and up projections)")
    if clamp is not None and not clamp > 0:
        raise ConfigError(f"model.activation_func_clamp_value={clamp!r} must be a positive number or None")


def check_mtp(config: Any) -> None:
    """Multi-token prediction: a positive depth count, a non-negative loss weight, and a layout that can place
    the depths (with pipeline stages, untied embeddings, the last stage holding a copy of the embedding)."""
    depths = config.mtp_num_layers
    _check_mtp_enabled(provider_field(config, "mtp_enabled", False), depths)
    if depths is None:
        return
    if isinstance(depths, bool) or not isinstance(depths, int) or depths < 1:
        raise ConfigError(f"model.mtp_num_layers={depths!r} must be a positive integer, or None to turn MTP off")
    factor = config.mtp_loss_scaling_factor
    if factor is None or not isinstance(factor, (int, float)) or factor < 0:
        raise ConfigError(f"model.mtp_loss_scaling_factor={factor!r} must be a number >= 0 when mtp_num_layers is set")
    pp = config.pipeline_model_parallel_size or 1
    if pp > 1 and config.share_embeddings_and_output_weights:
        raise NotSupportedError(
            f"model.mtp_num_layers={depths} with model.pipeline_model_parallel_size={pp} is not supported yet "
            "with model.share_embeddings_and_output_weights=True: untie them, or use one pipeline stage"
        )


def _check_mtp_enabled(enabled: Any, depths: Any) -> None:
    """``mtp_enabled=True`` asserts what ``mtp_num_layers`` switches on; False leaves it to mtp_num_layers."""
    if enabled and depths is None:
        raise ConfigError("model.mtp_enabled=True needs model.mtp_num_layers (the number of multi-token-prediction "
                          "depths, e.g. 1): set it, or mtp_enabled=False")


def _check_heads(config: Any) -> None:
    heads = config.num_attention_heads
    groups = config.num_query_groups or heads
    if heads <= 0 or heads % groups != 0:
        raise ConfigError(f"model.num_query_groups={groups} must divide model.num_attention_heads={heads}")
    if config.kv_channels is None and config.hidden_size % heads != 0:
        raise ConfigError(
            f"model.hidden_size={config.hidden_size} must divide by model.num_attention_heads={heads} "
            "(or set model.kv_channels)"
        )


def _check_rotary(config: Any) -> None:
    _check_rotary_base(config)
    if not 0.0 < config.rotary_percent <= 1.0:
        raise ConfigError(f"model.rotary_percent={config.rotary_percent} must be in (0, 1]")
    dim = head_dim(config)
    rot_dim = int(dim * config.rotary_percent) if config.rotary_percent < 1.0 else dim
    if rot_dim < 2 or rot_dim % 2 != 0:
        raise ConfigError(
            f"model.rotary_percent={config.rotary_percent} gives {rot_dim} rotary channels of "
            f"{dim}: it must be an even number >= 2"
        )


def _rope_scalings_set(config: Any) -> list[str]:
    """The RoPE frequency scalings ``config`` asks for, by the field that asks."""
    get = lambda name: getattr(config, name, None)  # noqa: E731 (providers without the field)
    asked = {
        "rope_scaling": bool(get("rope_scaling")),
        "position_embedding_type='yarn'": get("position_embedding_type") == "yarn",
        "rope_dynamic_factor": get("rope_dynamic_factor") is not None,
        "rope_longrope_short_factor": get("rope_longrope_short_factor") is not None,
    }
    return [name for name, on in asked.items() if on]


def check_rope_scaling(config: Any) -> None:
    """RoPE scaling fields: at most one scaling method (linear seq_len_interpolation_factor composes with any),
    each with the constants it needs, and no sequence-dependent one under context parallelism."""
    get = lambda name: getattr(config, name, None)  # noqa: E731 (providers without the field)
    asked = _rope_scalings_set(config)
    if len(asked) > 1:
        raise ConfigError(f"model: {' and '.join(asked)} each choose a RoPE scaling: set only one")
    interpolation = get("seq_len_interpolation_factor")
    if interpolation is not None and interpolation <= 0:
        raise ConfigError(f"model.seq_len_interpolation_factor={interpolation!r} must be positive (or None)")
    if not asked:
        return
    if asked[0] == "position_embedding_type='yarn'":
        # multi-latent attention takes YaRN's factor from rotary_scaling_factor (check_mla)
        needed = ("yarn_original_max_position_embeddings",) if get("multi_latent_attention") else (
            "yarn_rotary_scaling_factor", "yarn_original_max_position_embeddings")
        for name in needed:
            if get(name) is None or get(name) <= 0:
                raise ConfigError(f"model.{name}={get(name)!r}: position_embedding_type='yarn' needs it positive")
    if asked[0] in ("rope_dynamic_factor", "rope_longrope_short_factor"):
        original = get("rope_original_max_position_embeddings")
        if original is None or original <= 0:
            raise ConfigError(
                f"model.rope_original_max_position_embeddings={original!r}: model.{asked[0]} needs the "
                "pretraining context length (a positive int)"
            )
        if config.context_parallel_size > 1:
            raise NotSupportedError(
                f"model.{asked[0]} with context_parallel_size={config.context_parallel_size} is not supported: its "
                "frequencies depend on the whole sequence's length, which no rank sees"
            )
    if asked[0] == "rope_dynamic_factor" and get("rope_dynamic_factor") <= 0:
        raise ConfigError(f"model.rope_dynamic_factor={get('rope_dynamic_factor')!r} must be positive")
    if asked[0] == "rope_longrope_short_factor":
        _check_longrope(config)


def _check_longrope(config: Any) -> None:
    dim = head_dim(config)
    pairs = (int(dim * config.rotary_percent) if config.rotary_percent < 1.0 else dim) // 2
    for name in ("rope_longrope_short_factor", "rope_longrope_long_factor"):
        factors = getattr(config, name, None)
        if factors is None or len(factors) != pairs:
            raise ConfigError(
                f"model.{name} has {None if factors is None else len(factors)} entries: LongRoPE needs one per "
                f"rotary frequency ({pairs})"
            )
    if provider_field(config, "rope_attention_factor", None) is None:
        raise ConfigError(
            "model.rope_attention_factor=None: LongRoPE needs its cos/sin scale (transformers' default: "
            "sqrt(1 + ln(factor) / ln(rope_original_max_position_embeddings)))"
        )


def _check_rotary_base(config: Any) -> None:
    """``rotary_base``: a positive number, or a ``[local, global]`` pair of them (then no Llama-3 scaling: the
    pair's global scaling is ``rope_scaling_factor``, linear)."""
    base = config.rotary_base
    pair = isinstance(base, (list, tuple))
    values = list(base) if pair else [base]
    if (pair and len(values) != 2) or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in values
    ):
        raise ConfigError(
            f"model.rotary_base={base!r} is out of range: use a positive number or a [local, global] pair of "
            "positive numbers"
        )
    if pair and provider_field(config, "rope_scaling", False):
        raise NotSupportedError(
            f"model.rope_scaling=True with model.rotary_base={list(base)!r} is not supported: with a "
            "[local, global] pair the global layers' scaling is rope_scaling_factor (linear); set rope_scaling=False"
        )
    if pair:
        _check_no_other_rope_scaling(config, f"model.rotary_base={list(base)!r}",
                                     "with a [local, global] pair the global layers' scaling is rope_scaling_factor "
                                     "(linear)")


def _check_no_other_rope_scaling(config: Any, setting: str, why: str) -> None:
    """YaRN, dynamic NTK and LongRoPE are built on the single rotary table only: refuse them beside ``setting``."""
    scalings = (("position_embedding_type", "yarn", "'rope'"), ("rope_dynamic_factor", None, "None"),
                ("rope_longrope_short_factor", None, "None"))
    for name, off, leave in scalings:
        value = getattr(config, name, None)
        if (value == off) if off is not None else (value is not None):
            raise NotSupportedError(f"model.{name}={value!r} with {setting} is not supported: {why}; "
                                    f"leave {name} at {leave}")


def _check_norms_and_caps(config: Any) -> None:
    """QK-norm across heads, the soft-capping values."""
    if provider_field(config, "qk_layernorm_across_heads", False):
        if not config.qk_layernorm:
            raise ConfigError("model.qk_layernorm_across_heads=True needs model.qk_layernorm=True")
        tp = config.tensor_model_parallel_size
        if tp > 1 and config.normalization != "RMSNorm":  # the head-sharded norm sums squares over the ranks
            raise NotSupportedError(
                f"model.qk_layernorm_across_heads=True with normalization={config.normalization!r} and "
                f"tensor_model_parallel_size={tp} is not supported (the norm spans every head): use RMSNorm or "
                "tensor_model_parallel_size=1"
            )
    cp = config.context_parallel_size
    if provider_field(config, "attn_logit_softcapping", None) and cp > 1:
        raise NotSupportedError(
            f"model.attn_logit_softcapping with context_parallel_size={cp} is not supported (context parallel "
            "attention has no soft-cap): use context_parallel_size=1"
        )
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        cap = getattr(config, name, None)
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or cap <= 0):
            raise ConfigError(f"model.{name}={cap!r} must be a positive number (or None: off)")


def _check_recompute(config: Any) -> None:
    if config.recompute_granularity not in (None, "full", "selective"):
        raise NotSupportedError(
            f"model.recompute_granularity={config.recompute_granularity!r} is not supported: "
            "use None, 'full' or 'selective'"
        )
    if config.recompute_granularity == "full":
        if config.recompute_method not in ("uniform", "block"):
            raise NotSupportedError(
                f"model.recompute_method={config.recompute_method!r} is not supported with "
                "recompute_granularity='full': use 'uniform' or 'block'"
            )
        if not config.recompute_num_layers or config.recompute_num_layers < 1:
            raise ConfigError(
                f"model.recompute_num_layers={config.recompute_num_layers!r} must be a positive integer "
                "with recompute_granularity='full'"
            )
    partial = config.num_microbatches_with_partial_activation_checkpoints
    if partial is not None:
        if isinstance(partial, bool) or not isinstance(partial, int) or partial < 0:
            raise ConfigError(
                f"model.num_microbatches_with_partial_activation_checkpoints={partial!r} must be an integer >= 0 "
                "(or None)")
        if (config.recompute_granularity, config.recompute_method) != ("full", "block"):
            raise ConfigError(
                f"model.num_microbatches_with_partial_activation_checkpoints={partial} needs "
                "recompute_granularity='full' and recompute_method='block' (the partial recompute it keeps for "
                f"those microbatches), not {config.recompute_granularity!r} / {config.recompute_method!r}")
    modules = config.recompute_modules
    if config.recompute_granularity == "selective" and modules not in (None, ["core_attn"]):
        raise NotSupportedError(
            f"model.recompute_modules={modules!r} is not supported: selective recompute covers ['core_attn'] only"
        )


def check_t5_model(config: Any) -> None:
    """The T5 model's checks."""
    check_fixed_fields(config, T5_FIXED_FIELDS, "yet by longspan's T5 model", T5_NOT_SUPPORTED_REASONS)
    _check_recompute(config)
    _check_t5_pipeline(config)
    if not config.attention_softmax_in_fp32 and config.context_parallel_size > 1:
        raise NotSupportedError(
            "model.attention_softmax_in_fp32=False is not supported with context_parallel_size > 1 (context "
            "parallel attention always accumulates in fp32): leave it True"
        )
    if config.position_embedding_type not in ("learned_absolute", "relative", "rope"):
        raise NotSupportedError(
            f"model.position_embedding_type={config.position_embedding_type!r} is not supported yet for T5: "
            "use 'learned_absolute', 'relative' or 'rope'"
        )
    if config.position_embedding_type == "rope":
        _check_rotary(_WithRotaryBase(config))
    if config.normalization not in ("LayerNorm", "RMSNorm"):
        raise NotSupportedError(f"model.normalization={config.normalization!r}: use 'LayerNorm' or 'RMSNorm'")
    if not callable(config.activation_func):
        raise ConfigError(f"model.activation_func={config.activation_func!r} is not callable")
    decoder_layers = config.num_layers
    encoder_layers = config.encoder_num_layers if config.encoder_num_layers is not None else decoder_layers
    if decoder_layers <= 0 or encoder_layers <= 0 or config.hidden_size <= 0:
        raise ConfigError(
            f"model.num_layers={decoder_layers}, model.encoder_num_layers={config.encoder_num_layers} and "
            f"model.hidden_size={config.hidden_size} must be positive"
        )
    check_stack_windows(config, [encoder_layers, decoder_layers])
    heads = config.num_attention_heads
    groups = config.num_query_groups or heads
    if heads <= 0 or groups != heads:
        raise NotSupportedError(
            f"model.num_query_groups={config.num_query_groups} is not supported yet for T5: leave it None "
            f"(one key/value head per query head, num_attention_heads={heads})"
        )
    if config.kv_channels is None and config.hidden_size % heads:
        raise ConfigError(
            f"model.hidden_size={config.hidden_size} must divide by model.num_attention_heads={heads} "
            "(or set model.kv_channels)"
        )
    longest = max(config.seq_length, config.seq_length_dec)
    if config.position_embedding_type == "learned_absolute" and longest > config.max_position_embeddings:
        raise ConfigError(
            f"model.max_position_embeddings={config.max_position_embeddings} is shorter than the longest "
            f"sequence (seq_length={config.seq_length}, seq_length_dec={config.seq_length_dec})"
        )
    if config.relative_attention_num_buckets <= 1 or config.relative_attention_max_distance <= 1:
        raise ConfigError(
            f"model.relative_attention_num_buckets={config.relative_attention_num_buckets} and "
            f"model.relative_attention_max_distance={config.relative_attention_max_distance} must be > 1"
        )


class _WithRotaryBase:
    """A T5 provider seen by the rotary checks: Megatron's T5 has no rotary_base field (its base is 10000)."""

    def __init__(self, config: Any) -> None:
        self._config = config

    def __getattr__(self, name: str) -> Any:
        if name == "rotary_base":
            return getattr(self._config, name, 10000)
        return getattr(self._config, name)


def _check_t5_pipeline(config: Any) -> None:
    """What T5's pipeline stages (one exchanged tensor of both stacks' hidden states) do not combine with."""
    pp = config.pipeline_model_parallel_size or 1
    if pp == 1:
        if config.encoder_pipeline_model_parallel_size:
            raise ConfigError(
                f"model.encoder_pipeline_model_parallel_size={config.encoder_pipeline_model_parallel_size} needs "
                "model.pipeline_model_parallel_size > 1: leave it 0"
            )
        return
    if config.share_embeddings_and_output_weights:
        raise NotSupportedError(
            f"model.share_embeddings_and_output_weights=True with pipeline_model_parallel_size={pp} is not "
            "supported for T5ModelProvider: set share_embeddings_and_output_weights=False"
        )
    for name in ("sequence_parallel", "context_parallel_size"):
        value = getattr(config, name, None)
        if value not in (None, False, 1):
            raise NotSupportedError(
                f"model.{name}={value!r} with pipeline_model_parallel_size={pp} is not supported yet for "
                "T5ModelProvider (stages exchange whole encoder and decoder sequences): use one or the other"
            )


MAMBA_POSITIVE_FIELDS = ("mamba_head_dim", "mamba_state_dim", "mamba_num_groups", "mamba_chunk_size",
                         "mamba_conv_kernel")


# The TransformerConfig fields MambaProvider models do not implement (at other than these values), each with why.
# (longspan.config.support shows the reasons in docs/config-support.md.)
MAMBA_NOT_SUPPORTED_REASONS: dict[str, tuple[Any, str]] = {
    "multi_latent_attention": (False, "the hybrid stack's attention layers are plain self-attention"),
    "mtp_num_layers": (None, "multi-token prediction depths are built for GPTModel only"),
}


def check_mamba_model(config: Any) -> None:
    """A Mamba/hybrid model's checks: its attention and MLP layers' (the GPT checks), then the Mamba fields.
    (That a pattern with MoE layers needs ``num_moe_experts`` is checked where the pattern is parsed.)"""
    check_gpt_model(config)
    for name, (supported, reason) in MAMBA_NOT_SUPPORTED_REASONS.items():
        value = getattr(config, name, supported)
        if value != supported and not (supported is False and not value):
            raise NotSupportedError(
                f"model.{name}={value!r} is not supported yet for MambaProvider models ({reason}): "
                f"leave it at {supported!r}"
            )
    if config.recompute_granularity is not None:
        raise NotSupportedError(
            f"model.recompute_granularity={config.recompute_granularity!r} is not supported yet for "
            "MambaProvider models: leave it None"
        )
    if config.moe_layer_freq != 1:
        raise NotSupportedError(
            f"model.moe_layer_freq={config.moe_layer_freq!r} is not supported for MambaProvider models: "
            "mark MoE layers with 'E' in model.hybrid_override_pattern"
        )
    for name in MAMBA_POSITIVE_FIELDS:
        if getattr(config, name) < 1:
            raise ConfigError(f"model.{name}={getattr(config, name)} must be a positive integer")
    d_inner, heads = mamba_inner_size(config)
    if config.mamba_dt_limit_min < 0:
        raise ConfigError(f"model.mamba_dt_limit_min={config.mamba_dt_limit_min} must be >= 0")
    groups = config.mamba_num_groups
    if heads < 1 or heads % groups != 0:
        raise ConfigError(f"model.mamba_num_groups={groups} must divide the Mamba heads ({heads})")
    # tensor and context parallel split the mixer by heads (context parallel: the whole sequence of a share)
    tp, cp = config.tensor_model_parallel_size, config.context_parallel_size
    if heads % (tp * cp) or groups % (tp * cp):
        raise ConfigError(
            f"model.tensor_model_parallel_size={tp} × model.context_parallel_size={cp} must divide the Mamba heads "
            f"({heads}) and model.mamba_num_groups={groups}"
        )


def mamba_inner_size(config: Any) -> tuple[int, int]:
    """Megatron's derivation: ``d_inner = mamba_num_heads · mamba_head_dim`` when the heads are given, else
    ``mamba_expand · hidden_size`` with ``heads = d_inner / mamba_head_dim``. Returns (d_inner, heads)."""
    head_size = config.mamba_head_dim
    if config.mamba_num_heads is not None:
        return config.mamba_num_heads * head_size, config.mamba_num_heads
    d_inner = int(config.mamba_expand * config.hidden_size)
    if d_inner % head_size != 0:
        raise ConfigError(
            f"model.mamba_expand·hidden_size={d_inner} must divide by model.mamba_head_dim={head_size} "
            "(or set model.mamba_num_heads)"
        )
    return d_inner, d_inner // head_size
