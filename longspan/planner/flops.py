"""Model FLOPs per training iteration (forward + backward), Megatron Bridge's formula.

For batch B, sequence s, hidden h, layers L, vocabulary V, query width q = kv_channels * heads, key/value width
k = kv_channels * query_groups, FFN width f, and F = 3 for gated (SwiGLU) MLPs else 2:

    B*s*[ 6*h*F*f*L + 6*L*(h*(q + 2k) + q*h) + 6*h*V ] + 6*q*L*B*s^2

(each matmul costs 2 FLOPs per multiply-add, training costs 3x the forward pass, and causal attention halves
the s^2 term). Per layer kind:

- an MoE layer (``moe_layer_freq``) replaces f by ``moe_ffn_hidden_size * moe_router_topk`` plus the shared
  experts' ``moe_shared_expert_intermediate_size``; the router's own small matmul is not counted (Megatron);
- multi-latent attention counts its projections (the query's down and up halves, or one query projection
  without ``q_lora_rank``; the key/value down projection with the shared rotary key; the key/value up
  projection; the output projection), its latent norms as Megatron does (one multiply-add per channel; only
  when the model has them, ``qk_layernorm``), and its causal core over ``qk_head_dim + qk_pos_emb_head_dim``
  (Q.K^T) and ``v_head_dim`` (P.V) channels per head;
- a gated DeltaNet layer (``experimental_attention_variant='gated_delta_net'``, the layers
  ``linear_attention_freq`` marks) has no s^2 term: with key / value widths K = key heads * key head dim,
  W = value heads * value head dim, it counts its projections ``h*(2K + 2W + 2*value heads) + W*h``, its
  depthwise conv ``(2K + W) * linear_conv_kernel_dim`` and the gated delta rule's state update and read-out,
  ``4 * value heads * key head dim * value head dim`` per token (the recurrent form's four products per state
  entry: decay, read, write, output); a full-attention layer's
  output gate (``attention_output_gate``) adds ``h*q``;
- a hybrid Mamba stack (``MambaProvider``: the layers of its pattern, ``M`` Mamba, ``*`` attention only, ``-``
  MLP only, ``E`` MoE only) counts, as Megatron's hybrid formula, a Mamba layer's ``in_proj``
  ``h*(2*d_inner + 2*groups*state + heads)``, ``out_proj`` ``d_inner*h`` and its scan, 7 FLOPs per
  ``d_inner*state`` and token for the whole step (7/6 multiply-adds); with ``moe_latent_size`` = l the routed
  experts run at width l (``l*F*moe_ffn*topk``) and the two latent projections add ``2*h*l``;
- multi-token prediction (``mtp_num_layers`` = D) adds per depth ``eh_proj`` (2h -> h), its three norms
  (enorm, hnorm, final norm: 3h, as Megatron counts them) and one transformer layer of the decoder's last
  layer's kind, and the shared output layer runs D + 1 times.

With PEFT (``cfg.peft``: LoRA, DoRA, CanonicalLoRA) the base is frozen: its weight matmuls run forward and
input-gradient but no weight-gradient (2/3 of the 6 FLOPs per weight and token), the attention core (no
weights) stays at 3x forward, and each adapter adds its own forward, input- and weight-gradient matmuls
(``adapter_multiply_adds_per_token``). DoRA's per-step weight norm and adapter dropout are not counted.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from torch import nn

from longspan.config.rules.model import mamba_inner_size
from longspan.core.vocab import calculate_padded_vocab_size

if TYPE_CHECKING:
    # Named for type checkers only: the FLOPs formula of a plain run stays free of the model code.
    from longspan.config.schema.container import ConfigContainer
    from longspan.models.gpt_provider import TransformerConfig
    from longspan.peft.config import LowRankAdapterConfig


@dataclasses.dataclass(frozen=True)
class MatmulTerms:
    """Forward multiply-adds of one token: ``weights`` through weight matrices (and the counted norms),
    ``core`` per position attended before the causal halving (attention's Q.K^T and P.V widths)."""

    weights: float
    core: float


def moe_layer_flags(model: TransformerConfig, num_layers: int) -> list[bool]:
    """Which layers are MoE layers (none without experts): ``layer_pattern.moe_layer_flags`` of the model."""
    if not model.num_moe_experts:
        return [False] * num_layers
    # Imported here: the training log imports this module, and the training state stays free of the models package
    from longspan.models.layer_pattern import moe_layer_flags as flags

    return flags(model.moe_layer_freq, num_layers)


def routed_expert_layer_flags(model: TransformerConfig) -> list[bool]:
    """Which layers of the decoder stack have routed experts: a hybrid stack's ``E`` layers of its pattern, else
    ``moe_layer_flags`` over ``num_layers``."""
    pattern = _hybrid_pattern(model)
    if pattern is not None:
        return [symbol == "E" for symbol in pattern]
    return moe_layer_flags(model, int(model.num_layers))


def _vocab_size(model: TransformerConfig) -> int:
    padded = model.padded_vocab_size
    if padded:
        return int(padded)
    return calculate_padded_vocab_size(int(model.vocab_size), int(model.make_vocab_size_divisible_by))


def _seq_length(cfg: ConfigContainer) -> int:
    seq = cfg.model.seq_length
    if not seq and cfg.dataset is not None:
        seq = cfg.dataset.seq_length
    if not seq:
        raise ValueError("num_floating_point_operations needs model.seq_length or dataset.seq_length")
    return int(seq)


def _attention_terms(model: TransformerConfig) -> MatmulTerms:
    """One layer's attention: projection multiply-adds per token and the core's width per position."""
    h = int(model.hidden_size)
    heads = int(model.num_attention_heads)
    if model.multi_latent_attention:
        return _mla_attention_terms(model, h, heads)
    groups = int(model.num_query_groups or heads)
    kv_channels = int(model.kv_channels or h // heads)
    q, k = kv_channels * heads, kv_channels * groups
    return MatmulTerms(weights=h * (q + 2 * k) + q * h, core=2 * q)


def _mla_attention_terms(model: TransformerConfig, h: int, heads: int) -> MatmulTerms:
    """Multi-latent attention (see the module docstring): the query path, the key/value down projection (latent
    and shared rotary key) and up projection, the output projection; the latent norms when the model has them."""
    q_head = int(model.qk_head_dim) + int(model.qk_pos_emb_head_dim)
    v_head = int(model.v_head_dim)
    kv_rank = int(model.kv_lora_rank)
    q_rank = model.q_lora_rank
    norms = 1 if model.qk_layernorm else 0
    query = h * heads * q_head if q_rank is None else int(q_rank) * (h + heads * q_head + norms)
    key_value = h * int(model.qk_pos_emb_head_dim) + kv_rank * (h + heads * (int(model.qk_head_dim) + v_head) + norms)
    return MatmulTerms(weights=query + key_value + heads * v_head * h, core=heads * (q_head + v_head))


def _gpt_field(model: TransformerConfig, name: str) -> object:
    """A field only GPT providers declare (the DeltaNet and output-gate fields), None on T5 and Mamba ones."""
    return getattr(model, name, None)  # getattr: declared by GPTModelProvider only, which this module does not import


def linear_attention_flags(model: TransformerConfig, num_layers: int) -> list[bool]:
    """Which layers are gated DeltaNet layers: ``layer_pattern.linear_attention_layer_flags`` of the model's
    ``linear_attention_freq`` when its attention variant is 'gated_delta_net', else none."""
    freq = _gpt_field(model, "linear_attention_freq")
    if _gpt_field(model, "experimental_attention_variant") != "gated_delta_net" or freq is None:
        return [False] * num_layers
    # Imported here: the training log imports this module, and the training state stays free of the models package
    from longspan.models.layer_pattern import linear_attention_layer_flags

    return linear_attention_layer_flags(freq, num_layers)


def _gated_delta_net_terms(model: TransformerConfig) -> MatmulTerms:
    """One gated DeltaNet layer (see the module docstring): per-token multiply-adds only, no s^2 core."""
    h = int(model.hidden_size)
    v_heads, k_dim, v_dim = int(model.linear_num_value_heads), int(model.linear_key_head_dim), int(
        model.linear_value_head_dim)
    key, value = int(model.linear_num_key_heads) * k_dim, v_heads * v_dim
    projections = h * (2 * key + 2 * value + 2 * v_heads) + value * h
    conv = (2 * key + value) * int(model.linear_conv_kernel_dim)
    return MatmulTerms(weights=float(projections + conv + 4 * v_heads * k_dim * v_dim), core=0.0)


def _mlp_multiply_adds(model: TransformerConfig, is_moe: bool) -> int:
    h = int(model.hidden_size)
    gated = 3 if model.gated_linear_unit else 2
    dense_ffn = int(model.ffn_hidden_size or 4 * h)
    if not is_moe:
        return gated * h * dense_ffn
    topk = int(model.moe_router_topk or 2)
    moe_ffn = int(model.moe_ffn_hidden_size or dense_ffn)
    shared_ffn = int(model.moe_shared_expert_intermediate_size or 0)
    return gated * h * (moe_ffn * topk + shared_ffn)


def _hybrid_pattern(model: TransformerConfig) -> str | None:
    """A MambaProvider's layer pattern (None for the other providers, which lack its fields)."""
    if not hasattr(model, "hybrid_override_pattern"):
        return None
    if model.hybrid_override_pattern is not None:
        return model.hybrid_override_pattern
    from longspan.models.mamba import allocate_layers  # the ratios' spread; a plain run's formula needs no model code

    return "".join(allocate_layers(int(model.num_layers), model.hybrid_attention_ratio, model.hybrid_mlp_ratio, None))


def _hybrid_layer_weights(model: TransformerConfig, symbol: str, attention: MatmulTerms) -> float:
    """Per-token multiply-adds of one hybrid layer of pattern ``symbol`` (see the module docstring)."""
    h = int(model.hidden_size)
    if symbol == "*":
        return attention.weights
    if symbol == "-":
        return _mlp_multiply_adds(model, False)
    if symbol == "E":
        latent = model.moe_latent_size
        if not latent:
            return _mlp_multiply_adds(model, True)
        gated = 3 if model.gated_linear_unit else 2
        routed = gated * int(latent) * int(model.moe_ffn_hidden_size or model.ffn_hidden_size) * int(
            model.moe_router_topk or 2)
        shared = gated * h * int(model.moe_shared_expert_intermediate_size or 0)
        return routed + shared + 2 * h * int(latent)
    d_inner, heads = mamba_inner_size(model)
    bc = 2 * int(model.mamba_num_groups) * int(model.mamba_state_dim)
    return h * (2 * d_inner + bc + heads) + d_inner * h + 7 / 6 * d_inner * int(model.mamba_state_dim)


def matmul_terms(model: TransformerConfig) -> MatmulTerms:
    """Forward multiply-adds per token of the whole model (decoder layers, MTP depths, output layer).

    Reads ``model``: num_layers, hidden_size, num_attention_heads, num_query_groups (default: heads),
    kv_channels (default: hidden/heads), ffn_hidden_size (default: 4*hidden), gated_linear_unit,
    padded_vocab_size (or vocab_size padded to make_vocab_size_divisible_by); for MoE num_moe_experts,
    moe_router_topk, moe_ffn_hidden_size, moe_shared_expert_intermediate_size, moe_layer_freq; for MLA
    multi_latent_attention, q_lora_rank, kv_lora_rank, qk_head_dim, qk_pos_emb_head_dim, v_head_dim,
    qk_layernorm; mtp_num_layers; for gated DeltaNet hybrids experimental_attention_variant,
    linear_attention_freq, linear_num_key_heads, linear_num_value_heads, linear_key_head_dim,
    linear_value_head_dim, linear_conv_kernel_dim, attention_output_gate.
    """
    h = int(model.hidden_size)
    pattern = _hybrid_pattern(model)
    if pattern is not None:  # no MTP on hybrid stacks
        attention = _attention_terms(model)
        weights = sum(_hybrid_layer_weights(model, symbol, attention) for symbol in pattern)
        return MatmulTerms(weights=float(weights + h * _vocab_size(model)), core=float(pattern.count("*") * attention.core))
    moe_flags = moe_layer_flags(model, int(model.num_layers))
    depths = int(model.mtp_num_layers or 0)
    layer_kinds = moe_flags + [moe_flags[-1]] * depths  # an MTP depth's layer is built like the last layer
    linear = linear_attention_flags(model, int(model.num_layers))
    linear += [linear[-1]] * depths
    attention = _attention_terms(model)
    if _gpt_field(model, "attention_output_gate"):
        attention = dataclasses.replace(attention, weights=attention.weights + h * _query_width(model))
    mixers = [_gated_delta_net_terms(model) if is_linear else attention for is_linear in linear]
    weights = sum(mixer.weights + _mlp_multiply_adds(model, is_moe) for mixer, is_moe in zip(mixers, layer_kinds))
    weights += depths * (2 * h * h + 3 * h)  # eh_proj and the depth's enorm, hnorm, final norm
    weights += (depths + 1) * h * _vocab_size(model)  # the output layer, shared by the MTP depths
    return MatmulTerms(weights=float(weights), core=float(sum(mixer.core for mixer in mixers)))


def _query_width(model: TransformerConfig) -> int:
    heads = int(model.num_attention_heads)
    return int(model.kv_channels or int(model.hidden_size) // heads) * heads


def num_floating_point_operations(cfg: ConfigContainer, batch_size: int = 1) -> float:
    """Training FLOPs (forward + backward) of one iteration over ``batch_size`` sequences of
    ``cfg.model.seq_length`` (else ``cfg.dataset.seq_length``) tokens; see the module docstring, ``matmul_terms``
    for the model fields read, and ``adapter_multiply_adds_per_token`` for ``cfg.peft``."""
    s = _seq_length(cfg)
    return floating_point_operations_of_tokens(cfg, int(batch_size) * s, int(batch_size) * s * s)


def floating_point_operations_of_tokens(cfg: ConfigContainer, tokens: int, attended: int) -> float:
    """Training FLOPs of ``tokens`` real tokens in sequences whose squared lengths sum to ``attended`` (the
    causal core's pairs before halving): the formula of ``num_floating_point_operations`` for batches whose rows
    differ in length, padding left out (SFT microbatches padded to their longest sample)."""
    terms = matmul_terms(cfg.model)
    core = 3.0 * terms.core * attended  # 2 FLOPs x 3 (forward + backward) x 1/2 (causal)
    peft = cfg.peft
    if peft is None:
        return 6.0 * terms.weights * tokens + core
    adapters = adapter_multiply_adds_per_token(cfg.model, peft)
    return 4.0 * terms.weights * tokens + core + 6.0 * adapters * tokens


def adapter_multiply_adds_per_token(model_cfg: TransformerConfig, peft: LowRankAdapterConfig) -> float:
    """Forward multiply-adds of one token through the adapters ``peft`` puts on ``model_cfg``'s model: per
    adapter group ``dim * (in + sum of the members' out)`` (one A shared by a fused group, a B per member);
    routed experts' adapters ``moe_router_topk`` times (each token runs through that many experts' adapters).
    The model is built once on the meta device to match the targets by name (cached per config)."""
    return _adapter_multiply_adds(repr(model_cfg), repr(peft), model_cfg, peft)


#: (repr of the model config, repr of the PEFT config) -> adapter multiply-adds per token: the formula runs
#: every iteration, the meta model is built once
_ADAPTER_CACHE: dict[tuple[str, str], float] = {}


def _adapter_multiply_adds(model_key: str, peft_key: str, model_cfg: TransformerConfig,
                           peft: LowRankAdapterConfig) -> float:
    cached = _ADAPTER_CACHE.get((model_key, peft_key))
    if cached is not None:
        return cached
    # Only PEFT runs need the adapter plan, and it pulls in the model code that the training state and the
    # FLOPs formula of a plain run stay free of.
    from longspan.peft.adapters import plan_adapters

    model = model_cfg.provide_meta()
    topk = int(model_cfg.moe_router_topk or 1)
    total = 0.0
    for names in plan_adapters(model, peft).values():
        layers = [model.get_submodule(name) for name in names]
        if isinstance(layers[0], nn.Linear):
            fan_in, outs, share = layers[0].in_features, [m.out_features for m in layers], 1
        else:  # routed experts' GroupedLinear [E, out, in]: one adapter per expert, top-k of them per token
            fan_in, outs, share = int(layers[0].weight.shape[2]), [int(m.weight.shape[1]) for m in layers], topk
        total += share * int(peft.dim) * (fan_in + sum(outs))
    if len(_ADAPTER_CACHE) > 16:
        _ADAPTER_CACHE.clear()
    _ADAPTER_CACHE[(model_key, peft_key)] = total
    return total
