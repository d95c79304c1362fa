"""Activation memory for ``longspan plan``: the bytes autograd saves for one microbatch, per part of the model.

The model's own forward runs on the meta device at one rank's local shapes (heads, FFN and vocabulary divided
by tp, sequence by cp) with a saved-tensor hook, so the recompute and fused-loss settings count as they run.
Attention is counted as a flash kernel saves it (O(s), no [s, s] weights), multi-latent attention included.

Layer kinds are measured apart: a dense layer (``ffn_hidden_size``) and an MoE layer (``moe_layer_freq``),
whose routed experts cannot run on the meta device (routing is data-dependent): it is measured as a dense
layer of width ``moe_ffn_hidden_size * moe_router_topk + moe_shared_expert_intermediate_size`` (each token's
top-k experts and the shared experts), plus what routing itself keeps per token (``routing_bytes_per_token``:
the permuted token copies, router scores and maps, the chosen experts' indices and weights). Multi-token
prediction depths (on the last stage, built like the last layer) are part of the output layer's share.

A gated DeltaNet hybrid's linear-attention layers (``linear_attention_freq``) are a kind of their own, measured
on a model of such layers: what their forward saves instead of attention's keys and values (the conv inputs,
the chunked rule's per-chunk recurrent states and its within-chunk tensors), with the DeltaNet heads divided
by tp like the attention heads.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Iterator

import torch
import torch.nn.functional as F

from longspan.config.rules.model import mamba_inner_size
from longspan.models.gpt import padded_vocab_size
from longspan.models.mamba import allocate_layers
from longspan.models.mtp import mtp_blocks
from longspan.parallel.mesh import Layout
from longspan.planner.flops import linear_attention_flags, moe_layer_flags


def dtype_bytes(dtype: Any) -> int:
    return torch.tensor([], dtype=dtype or torch.float32).element_size()


class _FlashAttentionSaves(torch.autograd.Function):
    """What a flash kernel keeps for backward, on the meta device: q, k, v, the output and the float32
    log-sum-exp per query (the CPU flash kernel's meta form assumes v's head width equals q's; multi-latent
    attention's differ)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
        ctx.save_for_backward(q, k, v, out, q.new_empty(q.shape[:-1], dtype=torch.float32))
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:  # pragma: no cover - never run
        raise NotImplementedError("the planner only measures the forward's saved tensors")


@contextlib.contextmanager
def _flash_attention_on_meta() -> Iterator[None]:
    """On the meta device SDPA takes its math path, which saves the [s, s] attention weights; training on a
    GPU (and torch's CPU kernel without an explicit mask) uses flash attention, which saves O(s). Count
    that: maskless SDPA calls run torch's flash kernel (its meta form) while measuring."""
    real = F.scaled_dot_product_attention

    def flash_like(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if attn_mask is not None or q.device.type != "meta":
            return real(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                        enable_gqa=enable_gqa)
        if k.shape[-3] != q.shape[-3]:
            k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
            v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
        if v.shape[-1] != q.shape[-1]:
            return _FlashAttentionSaves.apply(q, k, v)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, dropout_p, is_causal, scale=scale)[0]

    F.scaled_dot_product_attention = flash_like
    try:
        yield
    finally:
        F.scaled_dot_product_attention = real


def saved_bytes(provider: Any, mbs: int, seq: int, pre: bool, post: bool) -> float:
    """Bytes autograd saves for one forward of ``provider``'s model (meta device, parameters excluded)."""
    provider = copy.deepcopy(provider)
    provider.tensor_model_parallel_size = provider.pipeline_model_parallel_size = 1
    provider.context_parallel_size = provider.expert_model_parallel_size = 1
    provider.sequence_parallel = False
    model = provider.provide_meta(pre, post)
    model.train()
    for block in mtp_blocks(model):  # its per-depth loss log reads values, which meta tensors do not have
        block.training = False  # (the block's own flag only: its layers keep training mode and their dropout)
    params = {id(p) for p in model.parameters()}
    saved: dict[int, float] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        if id(base) not in params and id(t) not in params:
            saved[id(base)] = float(base.numel() * base.element_size())
        return t

    with torch.device("meta"), _flash_attention_on_meta(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        tokens = torch.zeros(mbs, seq, dtype=torch.long)
        if pre:
            model(tokens, labels=tokens)
        else:
            hidden = torch.zeros(mbs, seq, provider.hidden_size, dtype=provider.params_dtype, requires_grad=True)
            model(hidden, labels=tokens)
    return sum(saved.values())


def _hybrid_pattern(model_cfg: Any) -> str | None:
    """A hybrid Mamba stack's layer pattern (``M`` Mamba, ``*`` attention, ``-`` MLP, ``E`` MoE); None for
    providers without one (getattr: only MambaProvider declares the hybrid fields)."""
    if not hasattr(model_cfg, "hybrid_override_pattern"):
        return None
    return "".join(allocate_layers(int(model_cfg.num_layers), model_cfg.hybrid_attention_ratio,
                                   model_cfg.hybrid_mlp_ratio, model_cfg.hybrid_override_pattern))


def _local_mamba_heads(m: Any, tp: int) -> None:
    """A hybrid's Mamba heads and groups divided by tp (the mixer splits by heads)."""
    _, heads = mamba_inner_size(m)
    m.mamba_num_heads, m.mamba_num_groups = max(1, heads // tp), max(1, int(m.mamba_num_groups) // tp)


def local_provider(cfg: Any, layout: Layout, num_layers: int, moe: bool, linear: bool = False,
                   symbol: str | None = None) -> Any:
    """The model config of one rank's local computation, ``num_layers`` layers of one kind (an MoE layer as
    its dense stand-in, see the module docstring; gated DeltaNet layers with ``linear``; a hybrid Mamba stack's
    layers of pattern ``symbol``): heads, FFN and vocabulary divided by tp."""
    m = copy.deepcopy(cfg.model)
    tp = layout.tp
    heads = int(m.num_attention_heads)
    groups = int(m.num_query_groups or heads)
    m.kv_channels = m.kv_channels or m.hidden_size // heads
    m.num_attention_heads, m.num_query_groups = heads // tp, groups // tp
    if symbol is not None:  # the MoE stand-in is an MLP layer
        _local_mamba_heads(m, tp)
        m.hybrid_override_pattern = ("-" if symbol == "E" else symbol) * num_layers
    elif getattr(m, "experimental_attention_variant", None) is not None:
        m.linear_num_key_heads = max(1, int(m.linear_num_key_heads) // tp)
        m.linear_num_value_heads = max(1, int(m.linear_num_value_heads) // tp)
        m.linear_attention_freq = [int(linear)] * num_layers
    ffn = int(m.ffn_hidden_size or 4 * m.hidden_size)
    if moe:  # activations of routed tokens: top-k experts' FFN per token, and the shared experts'
        ffn = int(m.moe_ffn_hidden_size or ffn) * int(m.moe_router_topk or 1)
        ffn += int(m.moe_shared_expert_intermediate_size or 0)
    m.num_moe_experts = None
    m.moe_layer_freq = 1
    m.ffn_hidden_size = max(1, ffn // tp)
    m.vocab_size = padded_vocab_size(m) // tp
    m.make_vocab_size_divisible_by = 1
    m.set_num_layers(num_layers)
    m.recompute_granularity = m.recompute_granularity if m.recompute_granularity == "selective" else None
    m.recompute_method = m.recompute_num_layers = None
    return m


def routing_bytes_per_token(model_cfg: Any) -> float:
    """What an MoE layer's routing keeps per token beyond its dense stand-in: three copies of each routed
    token's hidden state (the rows permuted by expert, the experts' outputs, the probability-weighted outputs
    the scatter-add keeps), the float32 router scores and two boolean routing maps over the experts, and per
    chosen expert three int64 indices and two float32 weights."""
    topk = int(model_cfg.moe_router_topk or 1)
    experts = int(model_cfg.num_moe_experts)
    hidden_bytes = dtype_bytes(model_cfg.params_dtype)
    return 3 * topk * int(model_cfg.hidden_size) * hidden_bytes + experts * (4 + 2) + topk * (3 * 8 + 2 * 4)


#: the ``activation_parts`` keys of a hybrid Mamba stack's layers, by pattern symbol
HYBRID_PARTS = {"M": "mamba_layer", "*": "attention_layer", "-": "dense_layer", "E": "moe_layer"}


def layer_kinds(model_cfg: Any) -> list[tuple[bool, bool, str | None]]:
    """(MoE, gated DeltaNet, hybrid pattern symbol or None) of every layer of the model."""
    pattern = _hybrid_pattern(model_cfg)
    if pattern is not None:
        return [(symbol == "E", False, symbol) for symbol in pattern]
    layers = int(model_cfg.num_layers)
    return [(moe, linear, None) for moe, linear in zip(moe_layer_flags(model_cfg, layers),
                                                        linear_attention_flags(model_cfg, layers))]


def layer_part(moe: bool, linear: bool, symbol: str | None = None) -> str:
    """The ``activation_parts`` key of one layer kind."""
    if symbol is not None:
        return HYBRID_PARTS[symbol]
    return ("linear_" if linear else "") + ("moe_layer" if moe else "dense_layer")


def activation_parts(cfg: Any, layout: Layout) -> dict[str, float]:
    """Saved bytes of one microbatch: 'dense_layer' and 'moe_layer' (one transformer layer of each kind; 0
    for a kind the model lacks) and for gated DeltaNet hybrids 'linear_dense_layer' / 'linear_moe_layer'
    (``layer_part``), 'layer' (the largest), 'embedding', 'output' (final norm, output layer, loss and the MTP
    depths), and 'layer_input' (a layer's input hidden states)."""
    mbs = int(cfg.train.micro_batch_size)
    seq = int(cfg.model.seq_length) // layout.cp
    kinds = layer_kinds(cfg.model)
    last = kinds[-1]
    routing = mbs * seq * routing_bytes_per_token(cfg.model) if any(kind[0] for kind in kinds) else 0.0
    layers = {layer_part(moe, linear): 0.0 for moe in (False, True) for linear in (False, True)}
    if last[2] is not None:
        layers = {part: 0.0 for part in HYBRID_PARTS.values()}
    for kind in sorted(set(kinds), key=str):
        moe = kind[0]
        one = local_provider(cfg, layout, 1, *kind)
        full1 = saved_bytes(one, mbs, seq, True, True)
        stand_in = saved_bytes(local_provider(cfg, layout, 2, *kind), mbs, seq, True, True) - full1
        layers[layer_part(*kind)] = stand_in + (routing if moe else 0.0)
        if kind == last:  # the first and last stage's extra parts, measured on a model of the last kind
            pre1 = saved_bytes(one, mbs, seq, True, False)
            embedding = max(0.0, pre1 - stand_in)
            depths = int(cfg.model.mtp_num_layers or 0)
            output = max(0.0, full1 - pre1) + (depths * routing if moe else 0.0)
    hidden_bytes = dtype_bytes(cfg.model.params_dtype)
    return {
        **layers,
        "layer": max(layers.values()),
        "embedding": embedding,
        "output": output,
        "layer_input": float(mbs * seq * cfg.model.hidden_size * hidden_bytes),
    }


def stage_activations(cfg: Any, parts: dict[str, float], layer_numbers: list[int]) -> float:
    """Saved activations of a stage's transformer layers (global 0-based ``layer_numbers``) under the config's
    recompute setting: full recompute keeps each recomputed layer's input and, during backward, one layer's
    (or one recompute group's) activations."""
    m = cfg.model
    kinds = layer_kinds(m)
    per_layer = [parts[layer_part(*kinds[n])] for n in sorted(layer_numbers)]
    if m.recompute_granularity != "full" or not per_layer:
        return sum(per_layer)
    n = int(m.recompute_num_layers or 1)
    if m.recompute_method == "block":  # the stage's first n layers are recomputed
        recomputed = min(n, len(per_layer))
        return sum(per_layer[recomputed:]) + recomputed * parts["layer_input"] + max(per_layer[:recomputed])
    groups = -(-len(per_layer) // n)
    return groups * parts["layer_input"] + min(n, len(per_layer)) * max(per_layer)
