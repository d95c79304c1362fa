"""``TransformerConfig`` fields and the ``GPTModelProvider`` dataclass.

The provider is configuration (Megatron Core's ``TransformerConfig`` field names and defaults, plus the GPT
fields Megatron Bridge adds); ``provide()`` hands it to ``longspan.models.gpt.build_gpt_model``, which builds
a plain PyTorch module. Only fields that a user may set in a recipe or YAML are here; Megatron's runtime
objects (layer specs, init callables) are not configuration in longspan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional, Union

import torch
import torch.nn.functional as F

from longspan.core.model_parallel_config import ModelParallelConfig
from longspan.core.vocab import calculate_padded_vocab_size


@dataclass
class TransformerConfig(ModelParallelConfig):
    """Megatron Core's ``TransformerConfig`` model fields, with Megatron's defaults."""

    # ---- shape ---------------------------------------------------------------------------------------
    num_layers: int = 0
    """Number of transformer layers."""

    hidden_size: int = 0
    """Width of the residual stream."""

    num_attention_heads: int = 0
    """Number of query heads."""

    num_query_groups: Optional[int] = None
    """Number of key/value heads (grouped-query attention); None means one per query head."""

    ffn_hidden_size: Optional[int] = None
    """Width of the MLP's hidden layer; None means 4 * hidden_size."""

    kv_channels: Optional[int] = None
    """Width of each attention head; None means hidden_size // num_attention_heads."""

    softmax_scale: Optional[float] = None
    """Scale applied to attention scores; None means 1/sqrt(kv_channels)."""

    attention_backend: str = "auto"
    """Which SDPA kernels attention may use: 'auto' (SDPA chooses), 'flash', 'fused' (efficient/cuDNN, CUDA
    only), 'unfused' or 'local' (math); longspan.models.attention_backend."""

    # ---- dropout, norms, activations ---------------------------------------------------------------------
    hidden_dropout: float = 0.1
    """Dropout probability after the attention/MLP outputs and the embeddings."""

    attention_dropout: float = 0.1
    """Dropout probability on the attention weights."""

    fp32_residual_connection: bool = False
    """Keep the residual stream in fp32 (Megatron's semantics): the embeddings' output and every residual add
    are float32, each norm's output is cast back to params_dtype for the layer it feeds, and pipeline stages
    pass float32 hidden states. No effect with float32 parameters."""

    apply_residual_connection_post_layernorm: bool = False
    """Take the residual from after the layer norm instead of before it (Megatron's semantics): each sub-layer
    adds its output to its own normalized input, ``norm(x) + attn(norm(x))``, instead of ``x + attn(norm(x))``."""

    layernorm_epsilon: float = 1e-5
    """Epsilon of the normalization layers."""

    layernorm_zero_centered_gamma: bool = False
    """Store every norm's scale as (gamma - 1), centred at zero: the norm computes ``normed * (1 + w)`` (in
    float32 for RMSNorm, as Gemma does) and its weight starts at zero."""

    normalization: Literal["LayerNorm", "RMSNorm"] = "LayerNorm"
    """Normalization layer type."""

    qk_layernorm: bool = False
    """Normalize queries and keys per head before attention."""

    add_bias_linear: bool = True
    """Give the linear layers a bias."""

    add_qkv_bias: bool = False
    """Give only the query/key/value projections a bias (when add_bias_linear is False)."""

    gated_linear_unit: bool = False
    """Use a gated MLP (SwiGLU with silu, GeGLU with gelu)."""

    activation_func: Callable = F.gelu
    """MLP activation function (YAML: ``{_target_: torch.nn.functional.silu, _call_: false}``)."""

    num_moe_experts: Optional[int] = None
    """Number of experts in each MoE layer; None means a dense model."""

    rotary_interleaved: bool = False
    """Rotate interleaved channel pairs ``(x0, x1), (x2, x3), ...`` instead of the two halves of each head
    (Megatron's ``rotary_interleaved``; GPT-J / Meta's original Llama layout)."""

    window_size: Optional[list[int]] = None
    """If not None, then will use sliding window attention. The size of the window is specified by the numbers
    inside the tuple (left, right): a token attends to the ``left`` tokens before it and itself (right must be 0
    for a causal LM); -1 is the special value meaning "infinite window size". HF's ``sliding_window=W`` (W
    positions including the token itself) is ``(W - 1, 0)``."""

    window_attn_skip_freq: Optional[Union[int, list[int]]] = None
    """Frequency of full attention layers among sliding window attention layers. Accepts either:
    - An integer N: Represents a (N-1):1 ratio, one full attention layer after (N-1) SWA layers.
    - A list that defines a custom pattern, e.g.: [1,1,1,1,0,0,0,0], where 1 represents SWA.
    The list is also how a per-layer pattern is given directly (HF ``layer_types``: sliding_attention -> 1,
    full_attention -> 0). None: every layer uses the window."""

    multi_latent_attention: bool = False
    """Use multi-latent attention (DeepSeek-V2/V3): keys and values are expanded from a compressed per-token
    latent (kv_lora_rank) plus one rotary key shared by all heads (qk_pos_emb_head_dim). GPT models only; the
    MLA fields of GPTModelProvider (q_lora_rank, kv_lora_rank, ...) apply only when this is True."""

    test_mode: bool = False
    """Megatron's internal test switch."""

    calculate_per_token_loss: bool = False
    """Normalize the loss by the number of tokens in the global batch instead of averaging microbatch means."""

    # ---- initialization ------------------------------------------------------------------------------------
    init_method_std: float = 0.02
    """Standard deviation of the normal weight initialization."""

    embedding_init_method_std: Optional[float] = None
    """Standard deviation for the embedding weights; None means init_method_std."""

    init_model_with_meta_device: bool = False
    """Build the model on the meta device first. No effect: longspan always builds on meta and materializes
    each parameter from its seed after the parallel plans (kept so Bridge configs load)."""

    apply_query_key_layer_scaling: bool = False
    """Scale attention scores by the layer number (an fp16 stability trick)."""

    attention_softmax_in_fp32: bool = True
    """Compute the attention scores and softmax in fp32 when the model runs in lower precision (True: torch's
    scaled_dot_product_attention, which accumulates scores and softmax in fp32). False materializes the scores
    and the softmax probabilities in the activations' dtype (bf16/fp16) before multiplying by the values, as
    Megatron's unfused path does; identical to True for float32 models. Not with context parallelism."""

    # ---- fusions ---------------------------------------------------------------------------------------
    bias_activation_fusion: bool = False
    """Fuse bias add and activation."""

    masked_softmax_fusion: bool = False
    """Fuse scaling, masking and softmax."""

    persist_layer_norm: bool = False
    """Use the persistent fused layer norm kernel."""

    memory_efficient_layer_norm: bool = False
    """Use the memory-efficient fused layer norm kernel."""

    bias_dropout_fusion: bool = False
    """Fuse bias add, dropout and residual add."""

    apply_rope_fusion: bool = False
    """Use the fused RoPE kernel."""

    # ---- activation recomputation -------------------------------------------------------------------------
    recompute_granularity: Optional[Literal["full", "selective"]] = None
    """Recompute activations in the backward pass: 'full' layers or 'selective' (core attention); None = off."""

    recompute_method: Optional[Literal["uniform", "block"]] = None
    """With full recompute: 'uniform' recomputes chunks of recompute_num_layers; 'block' the first N layers."""

    recompute_num_layers: Optional[int] = None
    """With full recompute: layers per chunk ('uniform') or number of layers recomputed ('block')."""

    distribute_saved_activations: bool = False
    """Split saved activations across tensor-parallel ranks when recomputing."""

    recompute_modules: Optional[list[str]] = None
    """With selective recompute: which submodules to recompute (Megatron default: ['core_attn'])."""

    # ---- fp8 -------------------------------------------------------------------------------------------
    fp8: Optional[str] = None
    """FP8 training format ('e4m3' or 'hybrid': e4m3 forward, e5m2 gradients); None = off. longspan: the
    transformer layers' linears train in FP8 through torchao (longspan.parallel.float8; CUDA with the
    recipe's hardware and the fp8 extra, else a one-line error); each recipe takes the format its kernels
    compute ('tensorwise': either; 'rowwise', 'blockwise', 'mxfp8': 'e4m3')."""

    fp8_recipe: str = "delayed"
    """FP8 scaling recipe. longspan: 'tensorwise' (current scaling) and 'rowwise' (compute capability >= 8.9),
    'blockwise' (1x128/128x128 blocks, >= 9.0), 'mxfp8' (Blackwell, >= 10.0); 'delayed' is a one-line error
    (torchao removed delayed scaling)."""

    fp8_param: bool = False
    """Keep parameters in FP8. longspan: FSDP2 all-gathers float8 weights (fp8_recipe 'tensorwise' only; needs
    FSDP2 or the distributed optimizer)."""

    # ---- mixture of experts ------------------------------------------------------------------------------
    moe_shared_expert_intermediate_size: Optional[int] = None
    """Hidden width of the shared experts; None means no shared experts."""

    moe_shared_expert_gate: bool = False
    """Gate the shared experts' output."""

    moe_shared_expert_overlap: bool = False
    """Overlap shared-expert computation with token dispatch."""

    moe_latent_size: Optional[int] = None
    """Routed experts work in a latent space of this width: the layer projects each token down
    (``fc1_latent_proj``, hidden -> latent) before dispatch and the combined expert output back up
    (``fc2_latent_proj``) before the shared experts' output is added; the router and the shared experts see the
    full hidden state (Megatron's MoELayer). None: no projections, experts work on the hidden state. Tensor
    parallel splits both projections along the latent, so tensor_model_parallel_size must divide it."""

    moe_layer_freq: Union[int, list[int]] = 1
    """Which layers are MoE: every N-th layer (int) or a 0/1 pattern per layer (list)."""

    moe_ffn_hidden_size: Optional[int] = None
    """Hidden width of each expert's MLP; None means ffn_hidden_size."""

    moe_router_load_balancing_type: Union[str, list[str]] = "aux_loss"
    """Load balancing: 'aux_loss', 'seq_aux_loss', 'global_aux_loss', 'sinkhorn' or 'none'."""

    moe_router_topk: int = 2
    """Experts each token is routed to."""

    moe_router_topk_limited_devices: Optional[int] = None
    """Limit each token's experts to this many expert-parallel ranks (group-limited top-k with one group per
    expert-parallel rank; not together with moe_router_num_groups / moe_router_group_topk)."""

    moe_router_num_groups: Optional[int] = None
    """Number of expert groups for group-limited routing."""

    moe_router_group_topk: Optional[int] = None
    """Groups each token may pick from with group-limited routing."""

    moe_router_pre_softmax: bool = False
    """Apply softmax before top-k selection instead of after."""

    moe_router_topk_scaling_factor: Optional[float] = None
    """Scale the top-k routing weights by this factor."""

    moe_router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    """Router score function."""

    moe_router_dtype: Optional[Literal["fp32", "fp64"]] = None
    """dtype of the router computation; None means the model's dtype."""

    moe_router_enable_expert_bias: bool = False
    """Aux-loss-free load balancing (sigmoid scores only): a per-expert bias added to the scores to choose the
    top-k (not to the routing weights), updated once per step from the tokens each expert received."""

    moe_router_bias_update_rate: float = 1e-3
    """Update rate of the expert bias: each step it moves by this much towards balance (sign of mean - count)."""

    moe_grouped_gemm: bool = False
    """Run the experts as one grouped GEMM."""

    moe_aux_loss_coeff: Union[float, list[float]] = 0.0
    """Coefficient of the load-balancing auxiliary loss."""

    moe_z_loss_coeff: Optional[float] = None
    """Coefficient of the router z-loss; None = off."""

    moe_input_jitter_eps: Optional[float] = None
    """Multiplicative noise uniform in [1 - eps, 1 + eps] on the router's input while training; None = off."""

    moe_token_dropping: bool = False
    """Drop tokens above each expert's capacity (legacy switch): needs moe_expert_capacity_factor, which drops
    them whether or not this is set."""

    moe_token_dispatcher_type: Literal["allgather", "alltoall", "flex"] = "allgather"
    """How tokens reach their experts across expert-parallel ranks. Performance hint in longspan: tokens
    always move by all-to-all, which routes exactly as every dispatcher type does."""

    moe_per_layer_logging: bool = False
    """Log MoE statistics per layer."""

    moe_expert_capacity_factor: Optional[float] = None
    """Capacity of each expert as a multiple of the even share; None means no token dropping. Not with
    context_parallel_size > 1 (each rank would drop among its own chunks)."""

    moe_pad_expert_input_to_capacity: bool = False
    """Pad every expert's input to its full capacity."""

    moe_token_drop_policy: Literal["probs", "position"] = "probs"
    """Which tokens to drop above capacity: lowest probability or latest position."""

    moe_layer_recompute: bool = False
    """Recompute MoE layers in the backward pass."""

    moe_permute_fusion: bool = False
    """Use the fused token permutation kernel."""

    # ---- context parallel ------------------------------------------------------------------------------
    cp_comm_type: Optional[Union[str, list[str]]] = None
    """Context-parallel communication ('p2p', 'all_gather', 'a2a', 'a2a+p2p'); None means 'p2p'."""

    # ---- cuda graphs and misc ----------------------------------------------------------------------------
    enable_cuda_graph: bool = False
    """Capture CUDA graphs of the layers (CUDA only): each transformer layer compiles with torch.compile
    mode='reduce-overhead', whose CUDA-graph trees capture its forward and backward; needs train.torch_compile
    true or null."""

    cuda_graph_warmup_steps: int = 3
    """Training forwards each layer runs eager before its CUDA graph is captured (megatron-core's warmup runs)."""

    external_cuda_graph: bool = False
    """Megatron's Transformer Engine capture of the same layers (cuda_graph_impl='transformer_engine'); longspan
    captures them as enable_cuda_graph does. Not together with enable_cuda_graph."""

    clone_scatter_output_in_embedding: bool = True
    """Clone the embedding output after the sequence-parallel scatter."""

    disable_parameter_transpose_cache: bool = False
    """Do not cache transposed weights (TransformerEngine)."""

    config_logger_dir: str = ""
    """Directory of megatron-core's config logger: at build time each rank writes its model chunks' resolved config
    and module tree as ``{Model}.rank_{tp}_{dp}_{cp}_{pp}_{ep}.iter{chunk}.json``; empty = off."""

    flash_decode: bool = False
    """Use flash decoding for inference."""

    inference_rng_tracker: bool = False
    """Use an RNG tracker configured for inference."""

    transformer_impl: Literal["local", "transformer_engine", "inference_optimized"] = "transformer_engine"
    """Layer implementation Megatron uses; longspan always uses its own plain PyTorch layers."""

    mtp_num_layers: Optional[int] = None
    """Multi-token-prediction depths on the last stage; depth k predicts the token k+1 ahead; None = off.
    Not yet with pipeline stages and tied embeddings together (tensor, sequence, context, expert and data
    parallel work)."""

    mtp_loss_scaling_factor: Optional[float] = 0.1
    """Weight of the multi-token-prediction loss: the depths' mean loss times this joins the objective."""

    num_layers_in_first_pipeline_stage: Optional[int] = None
    """Layers on the first pipeline stage when the split is uneven."""

    num_layers_in_last_pipeline_stage: Optional[int] = None
    """Layers on the last pipeline stage when the split is uneven."""

    account_for_embedding_in_pipeline_split: bool = False
    """Count the embedding as a layer when splitting layers across pipeline stages."""

    account_for_loss_in_pipeline_split: bool = False
    """Count the loss as a layer when splitting layers across pipeline stages."""


class ModelProviderMixin:
    """What the model providers (``GPTModelProvider``, ``MambaProvider``, ``T5ModelProvider``) share:
    Megatron Core's derived defaults (``finalize``), the padded vocabulary, and ``provide()`` /
    ``provide_meta()`` over the provider's own ``build_model``."""

    def finalize(self) -> None:
        """Fill the derived Nones (ffn_hidden_size, num_query_groups, kv_channels) as Megatron Core does, and
        params_dtype from bf16 / fp16."""
        if self.ffn_hidden_size is None and self.hidden_size:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.num_query_groups is None and self.num_attention_heads:
            self.num_query_groups = self.num_attention_heads
        if self.kv_channels is None and self.num_attention_heads and self.hidden_size:
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.params_dtype is None:
            self.params_dtype = torch.bfloat16 if self.bf16 else torch.float16 if self.fp16 else torch.float32

    def set_num_layers(self, num_layers: int) -> None:
        """Make this a model of ``num_layers`` layers (the planner's probes of one layer kind); a provider whose
        other fields count layers adjusts them too."""
        self.num_layers = num_layers

    def pipeline_activation_width(self) -> int:
        """Per token, the width of what pipeline stages exchange: the hidden states (a model whose later stages
        need more, such as another stage's keys and values, packs them beside and says how wide that is)."""
        return int(self.hidden_size)

    @property
    def padded_vocab_size(self) -> Optional[int]:
        """vocab_size rounded up to make_vocab_size_divisible_by (independent of the parallel layout)."""
        if self.vocab_size is None:
            return None
        return calculate_padded_vocab_size(self.vocab_size, self.make_vocab_size_divisible_by)

    def build_model(self, pre_process: bool, post_process: bool, vp_stage: Optional[int],
                    layer_numbers: Optional[list[int]], materialize: bool) -> Any:
        """The provider's model (or the pipeline stage of ``layer_numbers``), initialized when ``materialize``,
        else on the meta device. Each provider defines it."""
        raise NotImplementedError

    def provide(self, pre_process: bool = True, post_process: bool = True, vp_stage: Optional[int] = None) -> Any:
        """Build and initialize the model (a plain ``torch.nn.Module``)."""
        return self.build_model(pre_process, post_process, vp_stage, layer_numbers=None, materialize=True)

    def provide_meta(self, pre_process: bool = True, post_process: bool = True, vp_stage: Optional[int] = None,
                     layer_numbers: Optional[list[int]] = None) -> Any:
        """The model (or a pipeline stage's ``layer_numbers``) on the meta device, for the parallel plans first
        (``longspan.models.builder.build_meta_model``)."""
        return self.build_model(pre_process, post_process, vp_stage, layer_numbers=layer_numbers, materialize=False)


@dataclass
class GPTModelProvider(ModelProviderMixin, TransformerConfig):
    """A decoder-only GPT model's configuration; ``provide()`` builds the model (Megatron Bridge's model provider)."""

    fp16_lm_cross_entropy: bool = False
    """Compute the output cross-entropy in fp16 instead of fp32."""

    parallel_output: bool = True
    """Keep the logits split across tensor-parallel ranks (the loss is vocab-parallel). Performance hint in
    longspan: the output layer's TP plan decides the logits' layout and the loss is the same either way."""

    share_embeddings_and_output_weights: bool = True
    """Tie the output layer's weight to the input embedding."""

    make_vocab_size_divisible_by: int = 128
    """Pad the vocabulary up to a multiple of this (longspan never multiplies it by the tensor-parallel size)."""

    position_embedding_type: Literal["learned_absolute", "rope", "yarn", "none"] = "learned_absolute"
    """Position information: learned absolute embeddings, rotary embeddings, rotary embeddings with YaRN scaling
    (the ``yarn_*`` fields), or none."""

    rotary_base: Union[int, float, list[float]] = 10000
    """Base of the rotary embedding frequencies; a pair ``[local, global]`` gives the sliding-window (local)
    layers their own base (Megatron Bridge's Gemma 3: ``(10_000, 1_000_000)``). With a pair,
    ``rope_scaling_factor`` is the linear scaling of the global layers' frequencies (they are divided by it,
    HF's ``linear`` rope type; 1.0 = none), as in Bridge's Gemma3ModelProvider, and ``rope_scaling`` must be
    False."""

    rotary_percent: float = 1.0
    """Fraction of each head's channels that rotary embeddings rotate."""

    seq_len_interpolation_factor: Optional[float] = None
    """Divide rotary positions by this factor (linear position interpolation); None = off."""

    rope_scaling: bool = False
    """Apply Llama-3.1 style frequency scaling to the rotary embeddings."""

    rope_scaling_factor: float = 8.0
    """Llama-3.1 rope scaling factor."""

    low_freq_factor: float = 1.0
    """Llama-3.1 rope scaling: low-frequency factor."""

    high_freq_factor: float = 4.0
    """Llama-3.1 rope scaling: high-frequency factor."""

    old_context_len: int = 8192
    """Llama-3.1 rope scaling: the original context length."""

    # ---- RoPE scaling: YaRN (Megatron's names), dynamic NTK and LongRoPE (HF rope_type semantics) -------------
    yarn_rotary_scaling_factor: Optional[float] = None
    """YaRN (position_embedding_type='yarn'): the context extension factor (HF ``factor``)."""

    yarn_original_max_position_embeddings: Optional[int] = None
    """YaRN: the pretraining context length its correction range is computed for."""

    yarn_beta_fast: Optional[float] = None
    """YaRN: rotations bounding the extrapolated (unscaled) frequencies; None = 32."""

    yarn_beta_slow: Optional[float] = None
    """YaRN: rotations bounding the interpolated (scaled) frequencies; None = 1."""

    yarn_mscale: Optional[float] = None
    """YaRN: cos/sin are scaled by ``(0.1·yarn_mscale·ln f + 1) / (0.1·yarn_mscale_all_dim·ln f + 1)``; None = 1."""

    yarn_mscale_all_dim: Optional[float] = None
    """YaRN: the denominator's mscale above; None = 0 (transformers' default attention factor 0.1·ln f + 1)."""

    yarn_correction_range_round_to_int: bool = True
    """YaRN: round the correction range outwards to whole dimensions (HF ``truncate``)."""

    rope_dynamic_factor: Optional[float] = None
    """Dynamic NTK-aware RoPE scaling (HF rope_type 'dynamic'), off when None: for a sequence of L >
    rope_original_max_position_embeddings positions (L = max(position_ids) + 1 of the forward) the base becomes
    ``base·(factor·L/original - (factor - 1))^(d/(d-2))``. With a KV cache each decoding step uses its own length,
    so cached keys keep the frequencies they were computed with (as transformers' generate)."""

    rope_longrope_short_factor: Optional[list[float]] = None
    """LongRoPE (HF rope_type 'longrope', Phi-3's 'su'), off when None: one divisor per rotary frequency
    (rotary channels / 2 of them) used while the sequence is at most rope_original_max_position_embeddings."""

    rope_longrope_long_factor: Optional[list[float]] = None
    """LongRoPE: the divisors used for longer sequences (set with rope_longrope_short_factor)."""

    rope_original_max_position_embeddings: Optional[int] = None
    """Dynamic NTK and LongRoPE: the pretraining context length at which their scaling starts (HF: dynamic's
    ``max_position_embeddings``, LongRoPE's ``original_max_position_embeddings``)."""

    rope_attention_factor: Optional[float] = None
    """YaRN and LongRoPE: the factor cos and sin are multiplied by. YaRN: None = the mscale ratio above;
    LongRoPE: required (transformers' default is sqrt(1 + ln(factor) / ln(original)), written by the HF import)."""
    # ---- Gemma 2/3 and OLMo-2: norm placement, soft-capping, embedding scale ------------------------------
    layernorm_before_sublayers: bool = True
    """Normalize the input of attention and of the MLP (the pre-norm of Llama and GPT). False together with
    layernorm_after_sublayers is OLMo-2's placement: ``x + norm(attn(x))``."""

    layernorm_after_sublayers: bool = False
    """Normalize the output of attention and of the MLP before the residual add: ``x + norm(attn(...))``
    (Gemma 2/3's post-attention and post-feed-forward norms, OLMo-2's only norms)."""

    qk_layernorm_across_heads: bool = False
    """With qk_layernorm: normalize each token's whole query and key projections (all heads together, one
    weight per channel: OLMo-2) instead of each head separately. Under tensor parallel (RMSNorm only) each rank
    keeps its heads' weights and the mean square is summed over the ranks."""

    apply_embedding_scaling: bool = False
    """Multiply the word embeddings by sqrt(hidden_size), the factor rounded to the embeddings' dtype first
    (Gemma, as Hugging Face computes it)."""

    attn_logit_softcapping: Optional[float] = None
    """Cap attention scores softly, ``cap * tanh(score / cap)``, after scaling and before the mask and
    softmax (Gemma 2); None = off. Runs an unfused attention (scores are materialized)."""

    final_logit_softcapping: Optional[float] = None
    """Cap the output logits softly, ``cap * tanh(logits / cap)`` (Gemma 2), also inside the loss; None = off."""

    # ---- multi-latent attention (megatron-core's MLATransformerConfig; read when multi_latent_attention) ----
    q_lora_rank: Optional[int] = 512
    """Rank of Query tensor's low rank representation. None: no query compression (one linear_q_proj)."""

    kv_lora_rank: int = 512
    """Rank of Key and Value tensors' low rank representation."""

    qk_head_dim: int = 128
    """Dimension of the head in the QK projection. q_head_dim = qk_head_dim + qk_pos_emb_head_dim"""

    qk_pos_emb_head_dim: int = 64
    """Dimension of the position embedding in the QK projection."""

    v_head_dim: int = 128
    """Dimension of the head in the V projection."""

    rotary_scaling_factor: float = 40
    """Rotary scaling factor for the rotary embeddings, used by yarn. Multi-latent attention: the YaRN factor
    (position_embedding_type='yarn') and, with mscale_all_dim, the softmax scale
    ``mscale(factor, mscale_all_dim)^2 / sqrt(qk_head_dim + qk_pos_emb_head_dim)``."""

    mscale: float = 1.0
    """Mscale for YaRN RoPE in Multi-Latent Attention, used by yarn: cos/sin are scaled by
    ``mscale(f, mscale) / mscale(f, mscale_all_dim)`` with ``mscale(f, m) = 0.1·m·ln f + 1`` (f =
    rotary_scaling_factor; rope_attention_factor, when set, replaces the ratio)."""

    mscale_all_dim: float = 0.0
    """Mscale all dimensions for YaRN RoPE in Multi-Latent Attention, used by yarn: the ratio's denominator
    above, and the softmax scale's factor ``mscale(f, mscale_all_dim)^2`` (1 when 0)."""

    mla_latent_layernorm_epsilon: Optional[float] = None
    """Epsilon of multi-latent attention's latent norms (q_layernorm, kv_layernorm). None: layernorm_epsilon, as
    megatron-core. transformers' MLA (DeepSeek-V3, GLM-4.7-Flash) builds them with 1e-6 whatever rms_norm_eps
    says; an HF import sets it to 1e-6 where the other norms differ."""

    seq_length: int = 1024
    """Maximum sequence length the model is trained on (must equal dataset.sequence_length)."""

    vocab_size: Optional[int] = None
    """Vocabulary size before padding; None means it comes from the tokenizer at start-up."""

    should_pad_vocab: bool = False
    """Megatron Bridge flag: pad vocab_size itself. No effect in longspan, which always pads the embedding to
    make_vocab_size_divisible_by (and checks the tokenizer fits)."""

    scatter_embedding_sequence_parallel: bool = True
    """With sequence parallel: scatter the embedding output along the sequence right after the lookup. False
    keeps the embedding output whole and splits the decoder's input before the first layer (what a
    vision-language model needs to put its image embeddings in first); not with multi-token prediction."""

    tp_only_amax_red: bool = False
    """FP8: reduce amax only over the tensor-parallel group."""

    tp_comm_overlap_cfg: Optional[Union[str, dict[str, Any]]] = None
    """TransformerEngine userbuffer configuration for tp_comm_overlap."""

    use_transformer_engine_full_layer_spec: bool = False
    """Use TransformerEngine's full transformer layer."""

    use_transformer_engine_op_fuser: bool = False
    """Use TransformerEngine's operation fuser."""

    mtp_enabled: bool = False
    """Enable multi-token prediction. ``mtp_num_layers`` is the switch, as in megatron-core (Megatron Bridge
    stores this field and never reads it): True asserts MTP is on and needs mtp_num_layers set (a one-line
    ConfigError naming both fields otherwise); False, the default, leaves the choice to mtp_num_layers."""

    restore_modelopt_state: bool = False
    """Restore NVIDIA ModelOpt (quantization/sparsity) state from the checkpoint."""

    # ---- GPT-OSS: attention sinks and the clamped, offset SwiGLU ------------------------------------------------
    softmax_type: Literal["vanilla", "off-by-one", "learnable"] = "vanilla"
    """The attention softmax: 'vanilla' (plain; the fused SDPA path), 'off-by-one' (an extra zero logit per head
    in the denominator) or 'learnable' (an extra learned logit per head, ``self_attention.softmax_offset``
    [heads], starting at zero: GPT-OSS's attention sinks). Sinks run an unfused attention that materializes the
    scores; sliding-window layers keep their window; tensor parallel splits the sinks by heads. Not with context
    parallel or attn_logit_softcapping."""

    glu_linear_offset: float = 0.0
    """Added to the up projection of a gated MLP before the product: ``act(gate) * (up + offset)`` (GPT-OSS:
    1.0). Dense and expert MLPs; needs gated_linear_unit."""

    activation_func_clamp_value: Optional[float] = None
    """Clamp of a gated MLP's inputs before the activation: the gate above at this value, the up projection to
    ``[-value, value]`` (GPT-OSS: 7.0, HF ``swiglu_limit``); None = off. Needs gated_linear_unit."""

    # ---- gated DeltaNet hybrids (Qwen3-Next, Qwen3.5): longspan.models.gated_delta_net --------------------------
    experimental_attention_variant: Optional[Literal["gated_delta_net"]] = None
    """'gated_delta_net': the layers linear_attention_freq marks are gated DeltaNet linear attention (a recurrent
    state per value head updated by the gated delta rule) instead of softmax attention; None: every layer is
    softmax attention."""

    linear_attention_freq: Optional[Union[int, list[int]]] = None
    """Which layers are linear attention (with experimental_attention_variant): an int N makes (N-1) linear
    layers then one full-attention layer, repeating (layers with ``(i + 1) % N == 0`` are full attention); a
    list holds one entry per layer, 1 = linear attention, 0 = full attention (HF ``layer_types``)."""

    linear_conv_kernel_dim: int = 4
    """Width of the gated DeltaNet's causal depthwise convolution over its queries, keys and values."""

    linear_key_head_dim: int = 128
    """Width of each gated DeltaNet query/key head."""

    linear_value_head_dim: int = 128
    """Width of each gated DeltaNet value head (and of its output gate and gated norm)."""

    linear_num_key_heads: int = 16
    """Number of gated DeltaNet query/key heads."""

    linear_num_value_heads: int = 32
    """Number of gated DeltaNet value heads (a multiple of linear_num_key_heads: consecutive value heads share
    a key head)."""

    attention_output_gate: bool = False
    """Gate the full-attention layers' output per channel: a ``linear_gate`` projection beside ``linear_q``,
    and the attention output times ``sigmoid(gate)`` before ``linear_proj`` (Qwen3-Next, Qwen3.5)."""

    def build_model(self, pre_process: bool, post_process: bool, vp_stage: Optional[int],
                    layer_numbers: Optional[list[int]], materialize: bool) -> Any:
        """``longspan.models.gpt.build_gpt_model`` (see ``ModelProviderMixin``)."""
        from longspan.models.gpt import build_gpt_model  # keeps the providers (configs) free of the model code

        return build_gpt_model(self, pre_process, post_process, vp_stage, materialize=materialize,
                               layer_numbers=layer_numbers)
