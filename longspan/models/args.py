"""The typed arguments longspan's models are built from: a provider's fields, checked by the model rules
(``longspan.config.rules.model``) and with Megatron's derived defaults filled in (head size, FFN size,
padded vocabulary, MoE layer pattern, ...). The modules read these, never the provider's raw fields."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from longspan.config.rules.model import GPT_FIXED_FIELDS, T5_FIXED_FIELDS, check_gpt_model, check_t5_model, head_dim
from longspan.config.rules.moe import check_moe, moe_layer_flags, routing_groups, single_value
from longspan.config.rules.sliding_window import layer_windows, stack_window_flags, two_sided_window
from longspan.core.errors import ConfigError
from longspan.core.vocab import calculate_padded_vocab_size
from longspan.models.mla import MLAArgs, mla_softmax_scale
from longspan.models.rope import (
    BAND_HIGH_FREQ_FACTOR,
    BAND_LOW_FREQ_FACTOR,
    BAND_ORIGINAL_MAX_POSITIONS,
    RopeScaling,
)

_ROUTER_DTYPES = {None: None, "fp32": torch.float32, "fp64": torch.float64}


def padded_vocab_size(config: Any) -> int:
    """The provider's ``padded_vocab_size``, or vocab_size rounded up to make_vocab_size_divisible_by."""
    if getattr(config, "vocab_size", None) is None:
        raise ConfigError("model.vocab_size is None: set it, or let the tokenizer fill it in at start-up")
    padded = getattr(config, "padded_vocab_size", None)
    if padded is None:
        padded = calculate_padded_vocab_size(config.vocab_size, config.make_vocab_size_divisible_by)
    return int(padded)


@dataclass
class MoEArgs:
    """A mixture-of-experts model's router and expert settings (``longspan.models.moe``)."""

    num_experts: int
    topk: int
    ffn_hidden_size: int
    shared_ffn_hidden_size: Optional[int]
    shared_expert_gate: bool
    layer_flags: list[bool]
    aux_loss_coeff: float
    z_loss_coeff: Optional[float]
    pre_softmax: bool
    score_function: str
    num_groups: Optional[int]
    group_topk: Optional[int]
    topk_scaling_factor: Optional[float]
    router_dtype: Optional[torch.dtype]
    capacity_factor: Optional[float]
    drop_policy: str
    pad_to_capacity: bool
    per_layer_logging: bool
    calculate_per_token_loss: bool
    expert_bias: bool = False
    bias_update_rate: float = 1e-3
    input_jitter_eps: Optional[float] = None
    # moe_layer_recompute: each MoE layer's forward is checkpointed and replayed in backward
    layer_recompute: bool = False

    @classmethod
    def from_config(cls, config: Any, num_layers: int, ffn_hidden_size: int) -> Optional["MoEArgs"]:
        """The MoE settings of ``config`` (checked); None for a dense model."""
        check_moe(config)
        experts = getattr(config, "num_moe_experts", None)
        if not experts:
            return None
        balancing = single_value(getattr(config, "moe_router_load_balancing_type", "aux_loss"),
                                 "moe_router_load_balancing_type")
        aux_coeff = float(single_value(getattr(config, "moe_aux_loss_coeff", 0.0), "moe_aux_loss_coeff") or 0.0)
        capacity = getattr(config, "moe_expert_capacity_factor", None)
        num_groups, group_topk = routing_groups(config)
        return cls(
            num_experts=experts,
            topk=getattr(config, "moe_router_topk", 2),
            ffn_hidden_size=getattr(config, "moe_ffn_hidden_size", None) or ffn_hidden_size,
            shared_ffn_hidden_size=getattr(config, "moe_shared_expert_intermediate_size", None) or None,
            shared_expert_gate=bool(getattr(config, "moe_shared_expert_gate", False)),
            layer_flags=moe_layer_flags(getattr(config, "moe_layer_freq", 1), num_layers),
            aux_loss_coeff=0.0 if balancing == "none" else aux_coeff,
            z_loss_coeff=getattr(config, "moe_z_loss_coeff", None),
            pre_softmax=bool(getattr(config, "moe_router_pre_softmax", False)),
            score_function=getattr(config, "moe_router_score_function", "softmax"),
            num_groups=num_groups,
            group_topk=group_topk,
            topk_scaling_factor=getattr(config, "moe_router_topk_scaling_factor", None),
            router_dtype=_ROUTER_DTYPES[getattr(config, "moe_router_dtype", None)],
            capacity_factor=capacity,
            drop_policy=getattr(config, "moe_token_drop_policy", "probs"),
            pad_to_capacity=bool(getattr(config, "moe_pad_expert_input_to_capacity", False)),
            per_layer_logging=bool(getattr(config, "moe_per_layer_logging", False)),
            calculate_per_token_loss=bool(getattr(config, "calculate_per_token_loss", False)),
            expert_bias=bool(getattr(config, "moe_router_enable_expert_bias", False)),
            bias_update_rate=float(getattr(config, "moe_router_bias_update_rate", 1e-3)),
            input_jitter_eps=getattr(config, "moe_input_jitter_eps", None),
            layer_recompute=bool(getattr(config, "moe_layer_recompute", False)),
        )


def _recompute_granularity(config: Any) -> Optional[str]:
    """megatron-core turns moe_layer_recompute into selective recompute of ['core_attn', 'moe']: the attention
    core is recomputed too (a memory choice; the results are the same)."""
    if getattr(config, "moe_layer_recompute", False) and config.recompute_granularity is None:
        return "selective"
    return config.recompute_granularity


@dataclass
class MambaArgs:
    """A Mamba-2 mixer's sizes (``longspan.models.mamba``), with Megatron's derivation of d_inner and heads."""

    d_inner: int
    heads: int
    head_dim: int
    state_dim: int
    groups: int
    conv_kernel: int
    chunk_size: int
    dt_limit_min: float


@dataclass
class TransformerArgs:
    """What the GPT model's modules (and a hybrid model's attention/MLP layers) read."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    moe: Optional[MoEArgs]
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    softmax_scale: Optional[float]
    seq_length: int
    vocab_size: int
    normalization: str
    layernorm_epsilon: float
    activation_func: Callable[..., torch.Tensor]
    gated_linear_unit: bool
    add_bias_linear: bool
    add_qkv_bias: bool
    position_embedding_type: str
    rotary_base: float
    rotary_percent: float
    seq_len_interpolation_factor: Optional[float]
    rope_scaling: bool
    rope_scaling_factor: float
    low_freq_factor: float
    high_freq_factor: float
    old_context_len: int
    share_embeddings_and_output_weights: bool
    attention_dropout: float
    hidden_dropout: float
    init_method_std: float
    embedding_init_method_std: float
    qk_layernorm: bool
    params_dtype: torch.dtype
    fp16_lm_cross_entropy: bool
    cross_entropy_loss_fusion: bool
    recompute_granularity: Optional[str]
    recompute_method: Optional[str]
    recompute_num_layers: Optional[int]
    # pipelined runs with recompute_method='block': how many microbatches of each window of in-flight
    # microbatches keep the partial recompute; the others recompute every layer (the schedule decides)
    partial_checkpoint_microbatches: Optional[int] = None
    # hybrid (Mamba) models only: the layer type of each layer and the mixer's sizes
    layer_types: Optional[list[str]] = None
    mamba: Optional[MambaArgs] = None
    # decoder variants: norm form and placement, soft-capping, embedding scale, the local layers' RoPE base
    layernorm_zero_centered_gamma: bool = False
    layernorm_before_sublayers: bool = True
    layernorm_after_sublayers: bool = False
    qk_layernorm_across_heads: bool = False
    apply_embedding_scaling: bool = False
    attn_logit_softcapping: Optional[float] = None
    final_logit_softcapping: Optional[float] = None
    rotary_base_local: Optional[float] = None
    """From a ``[local, global]`` rotary_base: the sliding-window layers' base (``rotary_base`` is the global)."""
    global_rope_linear_factor: float = 1.0
    """With a ``[local, global]`` rotary_base: the global layers' frequencies are divided by this."""
    # sliding-window attention: Megatron's window_size (left, right), and each layer's window by global layer
    # index: the positions a token attends to, itself included (HF's sliding_window = left + 1), None = full
    # causal attention (see longspan.config.rules.sliding_window.layer_windows)
    window_size: Optional[tuple[int, int]] = None
    layer_windows: list[Optional[int]] = field(default_factory=list)
    # RoPE scalings (yarn, dynamic NTK, LongRoPE, llama3; linear is seq_len_interpolation_factor), interleaved
    # rotary pairs, and where the residual stream and the attention softmax are computed
    rope_scaling_method: Optional[RopeScaling] = None
    rotary_interleaved: bool = False
    apply_residual_connection_post_layernorm: bool = False
    fp32_residual_connection: bool = False
    attention_softmax_in_fp32: bool = True
    # GPT-OSS: attention sinks ('vanilla', 'off-by-one', 'learnable') and the gated MLP's offset and clamp
    softmax_type: str = "vanilla"
    glu_linear_offset: float = 0.0
    activation_func_clamp_value: Optional[float] = None
    # multi-latent attention's sizes and softmax scale (longspan.models.mla); None = the plain attention
    mla: Optional[MLAArgs] = None
    # multi-token prediction (longspan.models.mtp): depths (None = off), the weight of their averaged loss, and
    # whether losses are token sums (the MTP loss is then not divided by its token count)
    mtp_num_layers: Optional[int] = None
    mtp_loss_scaling_factor: float = 0.1
    calculate_per_token_loss: bool = False
    # with sequence parallel: whether the embedding's output is split along the sequence right after the lookup
    # (False: it stays whole and the decoder's input is split before the first layer, so a vision-language
    # model can put its image embeddings into the whole sequence first)
    scatter_embedding_sequence_parallel: bool = True

    @classmethod
    def from_config(cls, config: Any, fixed_fields: dict[str, Any] = GPT_FIXED_FIELDS) -> "TransformerArgs":
        """Check ``config`` (a GPTModelProvider, or any object with its TransformerConfig fields) and derive the
        arguments; the provider itself is not modified."""
        check_gpt_model(config, fixed_fields)
        ffn_hidden_size = config.ffn_hidden_size or 4 * config.hidden_size
        init_std = config.init_method_std
        return cls(
            num_layers=config.num_layers,
            hidden_size=config.hidden_size,
            ffn_hidden_size=ffn_hidden_size,
            moe=MoEArgs.from_config(config, config.num_layers, ffn_hidden_size),
            num_attention_heads=config.num_attention_heads,
            num_query_groups=config.num_query_groups or config.num_attention_heads,
            kv_channels=head_dim(config),
            softmax_scale=getattr(config, "softmax_scale", None),
            seq_length=config.seq_length,
            vocab_size=padded_vocab_size(config),
            normalization=config.normalization,
            layernorm_epsilon=config.layernorm_epsilon,
            activation_func=config.activation_func,
            gated_linear_unit=bool(config.gated_linear_unit),
            add_bias_linear=bool(config.add_bias_linear),
            add_qkv_bias=bool(config.add_qkv_bias),
            # YaRN is Megatron's position_embedding_type 'yarn': rotary embeddings with yarn_* scaling
            position_embedding_type="rope" if config.position_embedding_type == "yarn"
            else config.position_embedding_type,
            rotary_percent=float(config.rotary_percent),
            seq_len_interpolation_factor=getattr(config, "seq_len_interpolation_factor", None),
            rope_scaling=bool(config.rope_scaling),
            rope_scaling_factor=float(config.rope_scaling_factor),
            low_freq_factor=float(getattr(config, "low_freq_factor", BAND_LOW_FREQ_FACTOR)),
            high_freq_factor=float(getattr(config, "high_freq_factor", BAND_HIGH_FREQ_FACTOR)),
            old_context_len=int(getattr(config, "old_context_len", BAND_ORIGINAL_MAX_POSITIONS)),
            share_embeddings_and_output_weights=bool(config.share_embeddings_and_output_weights),
            attention_dropout=float(config.attention_dropout),
            hidden_dropout=float(config.hidden_dropout),
            init_method_std=init_std,
            embedding_init_method_std=getattr(config, "embedding_init_method_std", None) or init_std,
            qk_layernorm=bool(config.qk_layernorm),
            params_dtype=config.params_dtype or torch.float32,
            fp16_lm_cross_entropy=bool(getattr(config, "fp16_lm_cross_entropy", False)),
            cross_entropy_loss_fusion=bool(getattr(config, "cross_entropy_loss_fusion", False)),
            recompute_granularity=_recompute_granularity(config),
            recompute_method=config.recompute_method,
            recompute_num_layers=config.recompute_num_layers,
            partial_checkpoint_microbatches=getattr(config, "num_microbatches_with_partial_activation_checkpoints", None),
            window_size=_window_size(config),
            layer_windows=layer_windows(config),
            rope_scaling_method=rope_scaling_method(config),
            rotary_interleaved=bool(getattr(config, "rotary_interleaved", False)),
            apply_residual_connection_post_layernorm=bool(
                getattr(config, "apply_residual_connection_post_layernorm", False)),
            fp32_residual_connection=bool(getattr(config, "fp32_residual_connection", False)),
            attention_softmax_in_fp32=bool(getattr(config, "attention_softmax_in_fp32", True)),
            softmax_type=getattr(config, "softmax_type", "vanilla"),
            glu_linear_offset=float(getattr(config, "glu_linear_offset", 0.0)),
            activation_func_clamp_value=_optional_float(getattr(config, "activation_func_clamp_value", None)),
            mla=mla_args(config),
            mtp_num_layers=getattr(config, "mtp_num_layers", None) or None,
            mtp_loss_scaling_factor=float(getattr(config, "mtp_loss_scaling_factor", None) or 0.0),
            calculate_per_token_loss=bool(getattr(config, "calculate_per_token_loss", False)),
            scatter_embedding_sequence_parallel=bool(getattr(config, "scatter_embedding_sequence_parallel", True)),
            **_decoder_variant_fields(config),
        )


def _decoder_variant_fields(config: Any) -> dict[str, Any]:
    """The decoder variants of ``config`` beyond the standard decoder: zero-centred norms, norms before and/or
    after the sublayers, QK-norm across heads, embedding scaling, logit soft-capping and a RoPE base per layer
    kind (fields absent on providers without them: their defaults)."""
    base = config.rotary_base
    local = None
    global_factor = 1.0
    if isinstance(base, (list, tuple)):  # [local, global] (Bridge's Gemma 3); checked by the model rules
        local, base = float(base[0]), float(base[1])
        global_factor = float(config.rope_scaling_factor)
    caps = {name: getattr(config, name, None) for name in ("attn_logit_softcapping", "final_logit_softcapping")}
    return dict(
        rotary_base=float(base),
        rotary_base_local=local,
        global_rope_linear_factor=global_factor,
        layernorm_zero_centered_gamma=bool(getattr(config, "layernorm_zero_centered_gamma", False)),
        layernorm_before_sublayers=bool(getattr(config, "layernorm_before_sublayers", True)),
        layernorm_after_sublayers=bool(getattr(config, "layernorm_after_sublayers", False)),
        qk_layernorm_across_heads=bool(getattr(config, "qk_layernorm_across_heads", False)),
        apply_embedding_scaling=bool(getattr(config, "apply_embedding_scaling", False)),
        **{name: float(cap) if cap else None for name, cap in caps.items()},
    )


def _optional_float(value: Any) -> Optional[float]:
    return None if value is None else float(value)


def mla_args(config: Any) -> Optional[MLAArgs]:
    """The multi-latent attention settings of ``config`` (checked by the model rules); None without MLA."""
    if not getattr(config, "multi_latent_attention", False):
        return None
    return MLAArgs(
        q_lora_rank=config.q_lora_rank, kv_lora_rank=config.kv_lora_rank, qk_head_dim=config.qk_head_dim,
        qk_pos_emb_head_dim=config.qk_pos_emb_head_dim, v_head_dim=config.v_head_dim,
        softmax_scale=mla_softmax_scale(config.qk_head_dim, config.qk_pos_emb_head_dim,
                                        float(config.rotary_scaling_factor), float(config.mscale_all_dim)),
    )


def _window_size(config: Any) -> Optional[tuple[int, int]]:
    window = getattr(config, "window_size", None)
    return None if window is None else (int(window[0]), int(window[1]))


def rope_scaling_method(config: Any) -> Optional[RopeScaling]:
    """The provider's RoPE frequency scaling (checked by the model rules): YaRN (position_embedding_type 'yarn'),
    dynamic NTK, LongRoPE or Llama-3.1; None for none (or only the linear seq_len_interpolation_factor)."""
    get = lambda name, default=None: getattr(config, name, default)  # noqa: E731 (providers without the field)
    if get("position_embedding_type") == "yarn" and get("multi_latent_attention", False):
        # multi-latent attention's own YaRN constants (megatron-core's MLATransformerConfig)
        return RopeScaling(
            "yarn", factor=float(config.rotary_scaling_factor),
            original_max_positions=int(get("yarn_original_max_position_embeddings")),
            beta_fast=float(get("yarn_beta_fast") or 32.0), beta_slow=float(get("yarn_beta_slow") or 1.0),
            mscale=float(config.mscale), mscale_all_dim=float(config.mscale_all_dim),
            truncate=bool(get("yarn_correction_range_round_to_int", True)),
            attention_factor=get("rope_attention_factor"),
        )
    if get("position_embedding_type") == "yarn":
        return RopeScaling(
            "yarn", factor=float(get("yarn_rotary_scaling_factor")),
            original_max_positions=int(get("yarn_original_max_position_embeddings")),
            beta_fast=float(get("yarn_beta_fast") or 32.0), beta_slow=float(get("yarn_beta_slow") or 1.0),
            mscale=float(1.0 if get("yarn_mscale") is None else get("yarn_mscale")),
            mscale_all_dim=float(get("yarn_mscale_all_dim") or 0.0),
            truncate=bool(get("yarn_correction_range_round_to_int", True)),
            attention_factor=get("rope_attention_factor"),
        )
    if get("rope_dynamic_factor") is not None:
        return RopeScaling("dynamic", factor=float(get("rope_dynamic_factor")),
                           original_max_positions=int(get("rope_original_max_position_embeddings")))
    if get("rope_longrope_short_factor") is not None:
        return RopeScaling(
            "longrope", original_max_positions=int(get("rope_original_max_position_embeddings")),
            short_factor=tuple(float(x) for x in get("rope_longrope_short_factor")),
            long_factor=tuple(float(x) for x in get("rope_longrope_long_factor")),
            attention_factor=float(get("rope_attention_factor")),
        )
    if get("rope_scaling", False):
        return RopeScaling("llama3", factor=float(config.rope_scaling_factor),
                           low_freq_factor=float(get("low_freq_factor", BAND_LOW_FREQ_FACTOR)),
                           high_freq_factor=float(get("high_freq_factor", BAND_HIGH_FREQ_FACTOR)),
                           original_max_positions=int(get("old_context_len", BAND_ORIGINAL_MAX_POSITIONS)))
    return None


@dataclass
class T5Args:
    """What the T5 model's modules read."""

    encoder_num_layers: int
    decoder_num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    softmax_scale: Optional[float]
    vocab_size: int
    max_position_embeddings: int
    position_embedding_type: str
    relative_attention_num_buckets: int
    relative_attention_max_distance: int
    normalization: str
    layernorm_epsilon: float
    activation_func: Callable[..., torch.Tensor]
    gated_linear_unit: bool
    add_bias_linear: bool
    add_qkv_bias: bool
    share_embeddings_and_output_weights: bool
    scale_decoder_outputs: bool
    attention_dropout: float
    hidden_dropout: float
    init_method_std: float
    embedding_init_method_std: float
    params_dtype: torch.dtype
    fp16_lm_cross_entropy: bool
    qk_layernorm: bool = False
    rotary_percent: float = 1.0
    rotary_interleaved: bool = False
    rotary_base: float = 10000.0
    seq_len_interpolation_factor: Optional[float] = None
    apply_residual_connection_post_layernorm: bool = False
    attention_softmax_in_fp32: bool = True
    layernorm_zero_centered_gamma: bool = False
    # activation recompute (Megatron's semantics, per stack): None, 'full' or 'selective'
    recompute_granularity: Optional[str] = None
    recompute_method: Optional[str] = None
    recompute_num_layers: Optional[int] = None
    partial_checkpoint_microbatches: Optional[int] = None  # as TransformerArgs'
    # the residual stream in float32, each norm's output cast to params_dtype (as TransformerArgs')
    fp32_residual_connection: bool = False
    # one stack's depth (output projections scale their init std by it); set per stack with ``for_stack``
    num_layers: Optional[int] = None
    # sliding-window attention (longspan.config.rules.sliding_window.two_sided_window): Megatron's window_size
    # (left, right), -1 = that side unbounded, None = none; and which layers of each stack use it
    window_size: Optional[tuple[int, int]] = None
    encoder_layer_windowed: list[bool] = field(default_factory=list)
    decoder_layer_windowed: list[bool] = field(default_factory=list)

    @classmethod
    def from_config(cls, config: Any) -> "T5Args":
        """Check ``config`` (a T5ModelProvider) and derive the arguments."""
        check_t5_model(config)
        heads = config.num_attention_heads
        std = config.init_method_std
        encoder_layers = config.encoder_num_layers if config.encoder_num_layers is not None else config.num_layers
        encoder_windowed, decoder_windowed = stack_window_flags(config, [encoder_layers, config.num_layers])
        return cls(
            encoder_num_layers=encoder_layers,
            decoder_num_layers=config.num_layers,
            hidden_size=config.hidden_size,
            ffn_hidden_size=config.ffn_hidden_size or 4 * config.hidden_size,
            num_attention_heads=heads,
            num_query_groups=heads,
            kv_channels=config.kv_channels or config.hidden_size // heads,
            softmax_scale=config.softmax_scale,
            vocab_size=padded_vocab_size(config),
            max_position_embeddings=config.max_position_embeddings,
            position_embedding_type=config.position_embedding_type,
            relative_attention_num_buckets=config.relative_attention_num_buckets,
            relative_attention_max_distance=config.relative_attention_max_distance,
            normalization=config.normalization,
            layernorm_epsilon=config.layernorm_epsilon,
            activation_func=config.activation_func,
            gated_linear_unit=bool(config.gated_linear_unit),
            add_bias_linear=bool(config.add_bias_linear),
            add_qkv_bias=bool(config.add_qkv_bias),
            share_embeddings_and_output_weights=bool(config.share_embeddings_and_output_weights),
            scale_decoder_outputs=bool(config.scale_decoder_outputs),
            attention_dropout=float(config.attention_dropout),
            hidden_dropout=float(config.hidden_dropout),
            init_method_std=std,
            embedding_init_method_std=config.embedding_init_method_std or std,
            params_dtype=config.params_dtype or torch.float32,
            fp16_lm_cross_entropy=bool(config.fp16_lm_cross_entropy),
            qk_layernorm=bool(config.qk_layernorm),
            rotary_percent=float(config.rotary_percent),
            rotary_interleaved=bool(config.rotary_interleaved),
            rotary_base=float(getattr(config, "rotary_base", 10000.0)),
            seq_len_interpolation_factor=config.seq_len_interpolation_factor,
            apply_residual_connection_post_layernorm=bool(config.apply_residual_connection_post_layernorm),
            attention_softmax_in_fp32=bool(config.attention_softmax_in_fp32),
            layernorm_zero_centered_gamma=bool(config.layernorm_zero_centered_gamma),
            recompute_granularity=config.recompute_granularity,
            recompute_method=config.recompute_method,
            recompute_num_layers=config.recompute_num_layers,
            partial_checkpoint_microbatches=getattr(config, "num_microbatches_with_partial_activation_checkpoints", None),
            fp32_residual_connection=bool(getattr(config, "fp32_residual_connection", False)),
            window_size=two_sided_window(config),
            encoder_layer_windowed=encoder_windowed,
            decoder_layer_windowed=decoder_windowed,
        )

    def for_stack(self, num_layers: int) -> "T5Args":
        """These arguments with ``num_layers`` set to one stack's depth."""
        return dataclasses.replace(self, num_layers=num_layers)


__all__ = ["MambaArgs", "MoEArgs", "T5Args", "TransformerArgs", "padded_vocab_size", "rope_scaling_method",
           "GPT_FIXED_FIELDS", "T5_FIXED_FIELDS"]
