"""The typed arguments longspan's models are built from: a provider's fields, checked by the model rules
(``longspan.config.rules.model``) and with Megatron's derived defaults filled in (head size, FFN size,
padded vocabulary, MoE layer pattern, ...). The modules read these, never the provider's raw fields."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import torch

from longspan.config.rules.model import GPT_FIXED_FIELDS, T5_FIXED_FIELDS, check_gpt_model, check_t5_model, head_dim
from longspan.config.rules.moe import check_moe, routing_groups, single_value
from longspan.config.rules.sliding_window import two_sided_window
from longspan.core.errors import ConfigError
from longspan.models.layer_pattern import (
    layer_windows,
    linear_attention_layer_flags,
    moe_layer_flags,
    stack_window_flags,
)
from longspan.models.mla import MLAArgs, mla_softmax_scale
from longspan.models.rope import RopeScaling

if TYPE_CHECKING:  # the providers import the model code that imports these arguments
    from longspan.models.gpt_provider import GPTModelProvider, TransformerConfig
    from longspan.models.mamba_provider import MambaProvider
    from longspan.models.t5_provider import T5ModelProvider

_ROUTER_DTYPES = {None: None, "fp32": torch.float32, "fp64": torch.float64}


def padded_vocab_size(config: Union[GPTModelProvider, MambaProvider, T5ModelProvider]) -> int:
    """The provider's ``padded_vocab_size``: vocab_size rounded up to make_vocab_size_divisible_by."""
    if config.vocab_size is None:
        raise ConfigError("model.vocab_size is None: set it, or let the tokenizer fill it in at start-up")
    return int(config.padded_vocab_size)


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
    # moe_grouped_gemm: all local experts in one grouped matrix product per projection (longspan.models.moe)
    grouped_gemm: bool = False
    # moe_latent_size: the routed experts' input / output width when they work in a projected space
    latent_size: Optional[int] = None

    @classmethod
    def from_config(cls, config: TransformerConfig, num_layers: int, ffn_hidden_size: int) -> Optional["MoEArgs"]:
        """The MoE settings of ``config`` (checked); None for a dense model."""
        check_moe(config)
        experts = config.num_moe_experts
        if not experts:
            return None
        balancing = single_value(config.moe_router_load_balancing_type, "moe_router_load_balancing_type")
        aux_coeff = float(single_value(config.moe_aux_loss_coeff, "moe_aux_loss_coeff") or 0.0)
        num_groups, group_topk = routing_groups(config)
        return cls(
            num_experts=experts,
            topk=config.moe_router_topk,
            ffn_hidden_size=config.moe_ffn_hidden_size or ffn_hidden_size,
            shared_ffn_hidden_size=config.moe_shared_expert_intermediate_size or None,
            shared_expert_gate=bool(config.moe_shared_expert_gate),
            layer_flags=moe_layer_flags(config.moe_layer_freq, num_layers),
            aux_loss_coeff=0.0 if balancing == "none" else aux_coeff,
            z_loss_coeff=config.moe_z_loss_coeff,
            pre_softmax=bool(config.moe_router_pre_softmax),
            score_function=config.moe_router_score_function,
            num_groups=num_groups,
            group_topk=group_topk,
            topk_scaling_factor=config.moe_router_topk_scaling_factor,
            router_dtype=_ROUTER_DTYPES[config.moe_router_dtype],
            capacity_factor=config.moe_expert_capacity_factor,
            drop_policy=config.moe_token_drop_policy,
            pad_to_capacity=bool(config.moe_pad_expert_input_to_capacity),
            per_layer_logging=bool(config.moe_per_layer_logging),
            calculate_per_token_loss=bool(config.calculate_per_token_loss),
            expert_bias=bool(config.moe_router_enable_expert_bias),
            bias_update_rate=float(config.moe_router_bias_update_rate),
            input_jitter_eps=config.moe_input_jitter_eps,
            grouped_gemm=bool(config.moe_grouped_gemm),
            layer_recompute=bool(config.moe_layer_recompute),
            latent_size=config.moe_latent_size,
        )


def _recompute_granularity(config: TransformerConfig) -> Optional[str]:
    """megatron-core turns moe_layer_recompute into selective recompute of ['core_attn', 'moe']: the attention
    core is recomputed too (a memory choice; the results are the same)."""
    if config.moe_layer_recompute and config.recompute_granularity is None:
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
class GatedDeltaNetArgs:
    """A gated DeltaNet mixer's sizes (``longspan.models.gated_delta_net``) and which layers have one."""

    layer_flags: list[bool]
    """Per global layer index: True = gated DeltaNet (linear attention), False = full attention."""
    conv_kernel: int
    """linear_conv_kernel_dim: the causal depthwise conv's width."""
    key_head_dim: int
    """linear_key_head_dim."""
    value_head_dim: int
    """linear_value_head_dim."""
    num_key_heads: int
    """linear_num_key_heads (all of them; a tensor-parallel rank reads its share from the weights' shapes)."""
    num_value_heads: int
    """linear_num_value_heads (as num_key_heads)."""
    chunk_size: int = 64
    """Tokens per chunk of the chunked (WY) gated delta rule: a speed choice, the results are the same."""

    @classmethod
    def from_config(cls, config: GPTModelProvider) -> Optional["GatedDeltaNetArgs"]:
        """The gated DeltaNet settings of ``config`` (checked by the model rules); None without the variant."""
        if config.experimental_attention_variant is None:
            return None
        return cls(
            layer_flags=linear_attention_layer_flags(config.linear_attention_freq, config.num_layers),
            conv_kernel=config.linear_conv_kernel_dim,
            key_head_dim=config.linear_key_head_dim,
            value_head_dim=config.linear_value_head_dim,
            num_key_heads=config.linear_num_key_heads,
            num_value_heads=config.linear_num_value_heads,
        )


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
    # causal attention (see longspan.models.layer_pattern.layer_windows)
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
    # gated DeltaNet hybrids (longspan.models.gated_delta_net): the linear-attention layers and their mixer's
    # sizes (None = every layer is softmax attention), and the full-attention layers' sigmoid output gate
    gated_delta_net: Optional[GatedDeltaNetArgs] = None
    attention_output_gate: bool = False

    @classmethod
    def from_config(cls, config: Union[GPTModelProvider, MambaProvider],
                    fixed_fields: dict[str, Any] = GPT_FIXED_FIELDS,
                    gpt: Optional[GPTModelProvider] = None) -> "TransformerArgs":
        """Check ``config`` (a GPTModelProvider, or a hybrid MambaProvider) and derive the arguments; the
        provider itself is not modified. ``gpt`` is where the GPT-only fields (RoPE scalings, MLA sizes, Gemma
        norms, attention sinks, ...) are read: ``config`` itself by default; a MambaProvider, which has none of
        them, passes ``GPTModelProvider()`` so its attention and MLP layers are derived as GPT's are."""
        check_gpt_model(config, fixed_fields)
        gpt = config if gpt is None else gpt
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
            softmax_scale=config.softmax_scale,
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
            seq_len_interpolation_factor=config.seq_len_interpolation_factor,
            rope_scaling=bool(gpt.rope_scaling),
            rope_scaling_factor=float(gpt.rope_scaling_factor),
            low_freq_factor=float(gpt.low_freq_factor),
            high_freq_factor=float(gpt.high_freq_factor),
            old_context_len=int(gpt.old_context_len),
            share_embeddings_and_output_weights=bool(config.share_embeddings_and_output_weights),
            attention_dropout=float(config.attention_dropout),
            hidden_dropout=float(config.hidden_dropout),
            init_method_std=init_std,
            embedding_init_method_std=config.embedding_init_method_std or init_std,
            qk_layernorm=bool(config.qk_layernorm),
            params_dtype=config.params_dtype or torch.float32,
            fp16_lm_cross_entropy=bool(config.fp16_lm_cross_entropy),
            cross_entropy_loss_fusion=bool(config.cross_entropy_loss_fusion),
            recompute_granularity=_recompute_granularity(config),
            recompute_method=config.recompute_method,
            recompute_num_layers=config.recompute_num_layers,
            partial_checkpoint_microbatches=config.num_microbatches_with_partial_activation_checkpoints,
            window_size=_window_size(config),
            layer_windows=layer_windows(config),
            rope_scaling_method=rope_scaling_method(config, gpt),
            rotary_interleaved=bool(config.rotary_interleaved),
            apply_residual_connection_post_layernorm=bool(config.apply_residual_connection_post_layernorm),
            fp32_residual_connection=bool(config.fp32_residual_connection),
            attention_softmax_in_fp32=bool(config.attention_softmax_in_fp32),
            softmax_type=gpt.softmax_type,
            glu_linear_offset=float(gpt.glu_linear_offset),
            activation_func_clamp_value=_optional_float(gpt.activation_func_clamp_value),
            mla=mla_args(config, gpt),
            mtp_num_layers=config.mtp_num_layers or None,
            mtp_loss_scaling_factor=float(config.mtp_loss_scaling_factor or 0.0),
            calculate_per_token_loss=bool(config.calculate_per_token_loss),
            scatter_embedding_sequence_parallel=bool(gpt.scatter_embedding_sequence_parallel),
            gated_delta_net=GatedDeltaNetArgs.from_config(gpt),
            attention_output_gate=bool(gpt.attention_output_gate),
            **_decoder_variant_fields(config, gpt),
        )


def _decoder_variant_fields(config: Union[GPTModelProvider, MambaProvider], gpt: GPTModelProvider) -> dict[str, Any]:
    """The decoder variants beyond the standard decoder: the rotary base(s) of ``config`` (one per layer kind), and
    of ``gpt`` the zero-centred norms, norms before and/or after the sublayers, QK-norm across heads, embedding
    scaling and logit soft-capping."""
    base = config.rotary_base
    local = None
    global_factor = 1.0
    if isinstance(base, (list, tuple)):  # [local, global] (Bridge's Gemma 3); checked by the model rules
        local, base = float(base[0]), float(base[1])
        global_factor = float(gpt.rope_scaling_factor)
    caps = {"attn_logit_softcapping": gpt.attn_logit_softcapping,
            "final_logit_softcapping": gpt.final_logit_softcapping}
    return dict(
        rotary_base=float(base),
        rotary_base_local=local,
        global_rope_linear_factor=global_factor,
        layernorm_zero_centered_gamma=bool(config.layernorm_zero_centered_gamma),
        layernorm_before_sublayers=bool(gpt.layernorm_before_sublayers),
        layernorm_after_sublayers=bool(gpt.layernorm_after_sublayers),
        qk_layernorm_across_heads=bool(gpt.qk_layernorm_across_heads),
        apply_embedding_scaling=bool(gpt.apply_embedding_scaling),
        **{name: float(cap) if cap else None for name, cap in caps.items()},
    )


def _optional_float(value: Any) -> Optional[float]:
    return None if value is None else float(value)


def mla_args(config: TransformerConfig, gpt: GPTModelProvider) -> Optional[MLAArgs]:
    """The multi-latent attention settings (``gpt``'s MLA sizes; checked by the model rules) when ``config``
    has multi_latent_attention; None without MLA."""
    if not config.multi_latent_attention:
        return None
    return MLAArgs(
        q_lora_rank=gpt.q_lora_rank, kv_lora_rank=gpt.kv_lora_rank, qk_head_dim=gpt.qk_head_dim,
        qk_pos_emb_head_dim=gpt.qk_pos_emb_head_dim, v_head_dim=gpt.v_head_dim,
        softmax_scale=mla_softmax_scale(gpt.qk_head_dim, gpt.qk_pos_emb_head_dim,
                                        float(gpt.rotary_scaling_factor), float(gpt.mscale_all_dim)),
        latent_norm_epsilon=_optional_float(gpt.mla_latent_layernorm_epsilon),
    )


def _window_size(config: TransformerConfig) -> Optional[tuple[int, int]]:
    window = config.window_size
    return None if window is None else (int(window[0]), int(window[1]))


def rope_scaling_method(config: Union[GPTModelProvider, MambaProvider],
                        gpt: Optional[GPTModelProvider] = None) -> Optional[RopeScaling]:
    """The provider's RoPE frequency scaling (checked by the model rules): YaRN (position_embedding_type 'yarn'),
    dynamic NTK, LongRoPE or Llama-3.1; None for none (or only the linear seq_len_interpolation_factor).
    ``gpt`` is where the GPT-only scaling fields are read (``TransformerArgs.from_config``); default ``config``."""
    gpt = config if gpt is None else gpt
    yarn = config.position_embedding_type == "yarn"
    if yarn and config.multi_latent_attention:
        # multi-latent attention's own YaRN constants (megatron-core's MLATransformerConfig)
        return RopeScaling(
            "yarn", factor=float(gpt.rotary_scaling_factor),
            original_max_positions=int(gpt.yarn_original_max_position_embeddings),
            beta_fast=float(gpt.yarn_beta_fast or 32.0), beta_slow=float(gpt.yarn_beta_slow or 1.0),
            mscale=float(gpt.mscale), mscale_all_dim=float(gpt.mscale_all_dim),
            truncate=bool(gpt.yarn_correction_range_round_to_int),
            attention_factor=gpt.rope_attention_factor,
        )
    if yarn:
        return RopeScaling(
            "yarn", factor=float(gpt.yarn_rotary_scaling_factor),
            original_max_positions=int(gpt.yarn_original_max_position_embeddings),
            beta_fast=float(gpt.yarn_beta_fast or 32.0), beta_slow=float(gpt.yarn_beta_slow or 1.0),
            mscale=float(1.0 if gpt.yarn_mscale is None else gpt.yarn_mscale),
            mscale_all_dim=float(gpt.yarn_mscale_all_dim or 0.0),
            truncate=bool(gpt.yarn_correction_range_round_to_int),
            attention_factor=gpt.rope_attention_factor,
        )
    if gpt.rope_dynamic_factor is not None:
        return RopeScaling("dynamic", factor=float(gpt.rope_dynamic_factor),
                           original_max_positions=int(gpt.rope_original_max_position_embeddings))
    if gpt.rope_longrope_short_factor is not None:
        return RopeScaling(
            "longrope", original_max_positions=int(gpt.rope_original_max_position_embeddings),
            short_factor=tuple(float(x) for x in gpt.rope_longrope_short_factor),
            long_factor=tuple(float(x) for x in gpt.rope_longrope_long_factor),
            attention_factor=float(gpt.rope_attention_factor),
        )
    if gpt.rope_scaling:
        return RopeScaling("llama3", factor=float(gpt.rope_scaling_factor),
                           low_freq_factor=float(gpt.low_freq_factor), high_freq_factor=float(gpt.high_freq_factor),
                           original_max_positions=int(gpt.old_context_len))
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
    # T5ModelProvider has no rotary_base field: RoPE uses Megatron's default base
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
    def from_config(cls, config: T5ModelProvider) -> "T5Args":
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
            seq_len_interpolation_factor=config.seq_len_interpolation_factor,
            apply_residual_connection_post_layernorm=bool(config.apply_residual_connection_post_layernorm),
            attention_softmax_in_fp32=bool(config.attention_softmax_in_fp32),
            layernorm_zero_centered_gamma=bool(config.layernorm_zero_centered_gamma),
            recompute_granularity=config.recompute_granularity,
            recompute_method=config.recompute_method,
            recompute_num_layers=config.recompute_num_layers,
            partial_checkpoint_microbatches=config.num_microbatches_with_partial_activation_checkpoints,
            fp32_residual_connection=bool(config.fp32_residual_connection),
            window_size=two_sided_window(config),
            encoder_layer_windowed=encoder_windowed,
            decoder_layer_windowed=decoder_windowed,
        )

    def for_stack(self, num_layers: int) -> "T5Args":
        """These arguments with ``num_layers`` set to one stack's depth."""
        return dataclasses.replace(self, num_layers=num_layers)


__all__ = ["GatedDeltaNetArgs", "MambaArgs", "MoEArgs", "T5Args", "TransformerArgs", "padded_vocab_size",
           "rope_scaling_method", "GPT_FIXED_FIELDS", "T5_FIXED_FIELDS"]
