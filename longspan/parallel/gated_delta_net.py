"""Tensor (and sequence) parallel and context parallel for gated DeltaNet mixers
(``longspan.models.gated_delta_net.GatedDeltaNet``, the linear-attention layers of the Qwen3-Next / Qwen3.5
hybrids). The full-attention and MLP/MoE layers of the same stack follow the GPT plans as they are.

**Tensor parallel: heads split.** Rank ``r`` of ``T`` holds and computes key heads ``[r·Hk/T, (r+1)·Hk/T)``
and value heads ``[r·Hv/T, (r+1)·Hv/T)``; since consecutive value heads share a key head, a rank's value
heads read exactly its key heads. ``linear_q`` / ``linear_k`` / ``linear_v`` / ``linear_z`` / ``linear_b`` /
``linear_a``, the conv segments ``conv_q`` / ``conv_k`` / ``conv_v`` and ``dt_bias`` / ``A_log`` are ``Shard(0)``
DTensors (a plain row split of each: the model keeps the segments apart, as the Mamba mixer does), ``linear_proj``
is ``Shard(1)``. The gated norm's weight (``[value_head_dim]``, one for every head) is replicated; each rank's
gradient of it is the partial sum over its heads, which the mixer's ``to_local(grad_placements=Partial)`` sums
over the ranks. Communication is at the mixer's boundary, as for the Mamba mixer (``shard_mixer_by_heads``):
without sequence parallel the replicated input's gradient is all-reduced and ``linear_proj``'s partial sums are
all-reduced; with ``sequence_parallel`` the layer's ``input_layernorm`` runs on its sequence shard, the mixer
all-gathers its input (backward: reduce-scatter) and reduce-scatters its output (backward: all-gather).

**Context parallel: all-to-all to heads** (``GatedDeltaNetContextParallel``), as for the Mamba mixer. Each rank
projects its own two load-balanced chunks of the sequence, one all-to-all hands it the whole sequence, in order,
of ``1/cp`` of its heads (of every projected segment), and conv, delta rule and gated norm run there with that
share of ``conv_*`` / ``dt_bias`` / ``A_log``; a second all-to-all brings back its own tokens of every head
before ``linear_proj``. Nothing of the recurrence crosses ranks.

Why not pass the recurrent and conv states from rank to rank along the sequence: with the load-balanced chunks
(rank ``r`` holds chunks ``r`` and ``2·cp−1−r``, which causal attention needs for balance) the state would visit
every rank twice, in ``2·cp`` strictly sequential steps (rank 0, 1, …, cp−1, cp−1, …, 0), so the ranks would mostly
wait; the backward pass would run the same chain in reverse. Packed sequences make it worse: every document
boundary inside a chunk resets the state, and a document spanning several chunks needs its state carried
across exactly those, so each rank would need the global document layout anyway. The all-to-all needs neither:
every rank sees whole sequences, so the documents' boundaries (``cu_seqlens``, in whole-sequence positions, which
the context-parallel plan leaves uncut) apply as on one process, and the chunked rule runs in parallel on every
rank. Its cost is two all-to-alls of the projected activations per layer (the same volume as Megatron's
attention all-to-all), and its constraint: ``tp · cp`` must divide the key heads (and so the value heads).

Each all-to-all's backward is the same exchange in reverse, so gradients are exact. A cp rank's slices of the
per-head parameters receive the gradients of its share of the heads only (zero elsewhere), and the norm weight
that of its heads; the data-parallel reduction over ``dp × cp`` sums them into the whole gradient, as it does
every parameter's (``longspan.parallel.context_parallel``).

Adapters on the projections (``longspan.peft``) are split with their base weights
(``longspan.parallel.mamba.adapter_placements``) and run on local tensors inside the mixer
(``LoRAAdapter.local_output``): the same exchanges carry them.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import SequenceParallel

from longspan.config.rules.layout import check_linear_attention_heads_split
from longspan.models.gated_delta_net import IN_PROJECTIONS, GatedDeltaNet
from longspan.models.gated_delta_rule import DocumentLayout
from longspan.parallel.heads_exchange import HeadsExchange
from longspan.parallel.mamba import adapter_placements, shard_mixer_by_heads

#: the mixer's parameters sharded along dim 0 (its heads' rows or channels), along dim 1, and replicated
ROW_SHARDED = ("linear_q.weight", "linear_k.weight", "linear_v.weight", "linear_z.weight", "linear_b.weight",
               "linear_a.weight", "conv_q.weight", "conv_k.weight", "conv_v.weight", "dt_bias", "A_log")
COLUMN_SHARDED = ("linear_proj.weight",)
REPLICATED = ("norm.weight",)


def is_gated_delta_net(module: Any) -> bool:
    """A gated DeltaNet mixer (a linear-attention layer's ``self_attention``)."""
    return isinstance(module, GatedDeltaNet)


def _check_split(mixer: GatedDeltaNet, cp: int) -> None:
    """The one-line error when the mixer's heads do not split over its tensor-parallel ranks (the ratio of its
    whole to its local heads, once tp applied) and ``cp``."""
    key_heads, value_heads = mixer.linear_q.weight.shape[0] // mixer.key_head_dim, mixer.linear_b.weight.shape[0]
    tp = key_heads * mixer.key_head_dim // mixer.local_parameters().linear_q.shape[0]
    check_linear_attention_heads_split(key_heads, value_heads, tp, cp)


def gated_delta_net_mixers(model: nn.Module) -> dict[str, GatedDeltaNet]:
    """Every gated DeltaNet mixer of ``model`` by module name."""
    return {name: m for name, m in model.named_modules() if is_gated_delta_net(m)}


def apply_gated_delta_net_tensor_parallel(model: nn.Module, tp_mesh: Any,
                                          sequence_parallel: bool = False) -> dict[str, Any]:
    """Shard every gated DeltaNet mixer of ``model`` by heads over ``tp_mesh`` (in place, meta or materialized).

    Returns the ``parallelize_module`` plan entries its layers need besides (with sequence parallel: each such
    layer's ``input_layernorm`` on sequence shards, handing the mixer a plain local shard it gathers itself).
    """
    mixers = gated_delta_net_mixers(model)
    tp = tp_mesh.size()
    for mixer in mixers.values():
        check_linear_attention_heads_split(mixer.linear_q.weight.shape[0] // mixer.key_head_dim,
                                           mixer.linear_b.weight.shape[0], tp, 1)
    placements = ([(n, Shard(0)) for n in ROW_SHARDED] + [(n, Shard(1)) for n in COLUMN_SHARDED]
                  + [(n, Replicate()) for n in REPLICATED])
    for mixer in mixers.values():
        shard_mixer_by_heads(mixer, tp_mesh, placements + adapter_placements(mixer, IN_PROJECTIONS, ["linear_proj"]),
                             sequence_parallel)
    if not sequence_parallel:
        return {}
    return {name.rsplit(".", 1)[0] + ".input_layernorm": SequenceParallel(use_local_output=True)
            for name in mixers if name.endswith(".self_attention")}


#: attribute set on a decoder whose DeltaNet mixers see a sequence this many times the decoder's own shard
MIXER_SEQUENCE_FACTOR_ATTR = "_longspan_mixer_sequence_factor"


def lengthen_document_layouts(model: nn.Module, factor: int) -> None:
    """The decoder works out the packed documents' layout (``DocumentLayout``) once per forward for its DeltaNet
    layers, on the length of the hidden states it gets. Under sequence parallel (``factor`` = tp) and context
    parallel (``factor`` = cp) those are a shard of the sequence, while the mixers run on the whole sequence
    they gather: each ``decoder`` (of this model or pipeline chunk) with DeltaNet layers gets a forward pre-hook,
    run after the plans' own input hooks, that builds the layout for ``factor`` times its length. Factors of
    several plans multiply."""
    decoder = getattr(model, "decoder", None)
    if factor == 1 or decoder is None or not gated_delta_net_mixers(decoder):
        return
    previous = getattr(decoder, MIXER_SEQUENCE_FACTOR_ATTR, None)
    setattr(decoder, MIXER_SEQUENCE_FACTOR_ATTR, (previous or 1) * factor)
    if previous is None:
        decoder.register_forward_pre_hook(_whole_sequence_layout, with_kwargs=True)


def _whole_sequence_layout(decoder: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    cu_seqlens = kwargs.get("cu_seqlens")
    if not isinstance(cu_seqlens, torch.Tensor):
        return None
    hidden = args[0] if args else kwargs["hidden_states"]
    length = hidden.shape[1] * getattr(decoder, MIXER_SEQUENCE_FACTOR_ATTR)
    return args, {**kwargs, "cu_seqlens": DocumentLayout.from_cu_seqlens(cu_seqlens, hidden.shape[0], length)}


class GatedDeltaNetContextParallel(HeadsExchange):
    """``GatedDeltaNet.context_parallel``: the exchanges over a cp ``group`` (a plain object, no parameters)."""

    def heads_of(self, p: SimpleNamespace) -> SimpleNamespace:
        """The mixer's local parameters cut to this rank's share of the heads. The projections run before the
        exchange on this rank's tokens of every head (``linear_q`` / ``linear_k`` / ``linear_v`` are cut only
        for their shapes, which give the rule its head counts); ``linear_proj`` runs after it, whole; the norm
        weight is every head's."""
        cut = {name: self.share(getattr(p, name)) for name in ("linear_q", "linear_k", "linear_v", "dt_bias", "A_log")}
        return SimpleNamespace(**{**vars(p), **cut, "conv": tuple(self.share(t) for t in p.conv)})

    def __repr__(self) -> str:
        return f"GatedDeltaNetContextParallel(all-to-all over {self.size} ranks)"


def apply_gated_delta_net_context_parallel(model: nn.Module, group: Any) -> int:
    """Give every gated DeltaNet mixer of ``model`` the exchange over ``group``; returns how many. The cp size must
    divide the key and value heads each mixer holds (a tensor-parallel rank's share, when tp is applied)."""
    mixers = list(gated_delta_net_mixers(model).values())
    if not mixers:
        return 0
    exchange = GatedDeltaNetContextParallel(group)
    for mixer in mixers:
        _check_split(mixer, exchange.size)
    for mixer in mixers:
        mixer.context_parallel = exchange
    lengthen_document_layouts(model, exchange.size)
    return len(mixers)
