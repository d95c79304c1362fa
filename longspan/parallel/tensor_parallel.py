"""Tensor and sequence parallel plans for ``GPTModel`` (DTensor ``parallelize_module``, torchtitan's way).

The model stays plain; the plan names its modules (see ``longspan.models.gpt``) and says how each is split
over the 1-D ``tp`` mesh:

- attention: ``linear_q`` / ``linear_k`` / ``linear_v`` column-wise (each rank keeps whole heads and whole
  kv groups: the attention code reads its local head counts from the projected shapes), ``linear_proj``
  row-wise; the per-head QK-norms (``q_layernorm`` / ``k_layernorm``) keep replicated weights and see
  head-sharded inputs, so their gradients are summed over every rank's heads; QK-norms across heads are split
  with the heads, their statistic summed over the ranks (``longspan.parallel.across_heads_norm``);
- multi-latent attention: ``linear_q_proj`` / ``linear_q_up_proj`` and ``linear_kv_up_proj`` column-wise,
  ``linear_proj`` row-wise; the down-projections and latent norms replicated (see ``_mla_plan``);
- attention's output gate (``attention_output_gate``: ``linear_gate``) column-wise, like the queries; gated
  DeltaNet mixers (linear-attention layers) are sharded by heads by ``longspan.parallel.gated_delta_net``;
- MLP: ``linear_fc1`` and ``linear_fc1_gate`` column-wise, ``linear_fc2`` row-wise;
- vocabulary: ``embedding.word_embeddings`` row-wise (vocab-sharded table, masked lookup + all-reduce) and
  ``output_layer`` column-wise with vocab-sharded ``DTensor`` logits (``Shard(-1)``, ``use_local_output=False``),
  so that ``F.cross_entropy`` under ``torch.distributed.tensor.parallel.loss_parallel()`` is vocab-parallel:
  no rank ever holds full-vocabulary logits. Outside that context the output layer gathers its logits (the
  loss stays correct, e.g. in evaluation, but is not vocab-parallel). The per-token loss leaves the model as
  a plain tensor (a forward hook on the root takes the replicated local value), so loss functions and the
  trainer see ordinary tensors.
- tied embeddings (``share_embeddings_and_output_weights``), Megatron's way: the output projection uses the
  very word-embedding parameter, a ``DTensor`` sharded over the vocabulary (``Shard(0)``), so each rank's
  logits are those of its own vocabulary rows (``Shard(-1)``, as the untied output layer's) and the weight's
  gradient is the sum of the lookup's and the projection's, accumulated into one sharded tensor. The plan
  only lays out the input of the parameter-free ``tied_output`` (replicated hidden states; under sequence
  parallel gathered from sequence shards); the rest is DTensor's matmul on a replicated input and a sharded
  weight, which needs no communication.

With ``sequence_parallel`` the residual stream between the column/row pairs is sharded along the sequence
(dim 1): the whole embedded sequence is split along the sequence (the embedding's output, or, with
``scatter_embedding_sequence_parallel=False``, the decoder's input before the first layer), norms run as
``SequenceParallel`` on their shard, attention/MLP inputs are all-gathered (``PrepareModuleInput``), and
``linear_proj`` / ``linear_fc2`` reduce-scatter back to sequence shards. The final norm feeds the output layer,
which all-gathers its input.

Randomness: hidden dropout on the replicated residual stream (tp without sp) draws the same mask on every tp
rank, the one a single process draws. Under sequence parallel the residual dropouts are replaced by
``SequenceShardedDropout``, which draws the full-sequence mask and keeps this rank's slice, so the masks do
not depend on the layout either. Attention dropout (inside SDPA, on local heads) is drawn per rank and does
depend on the layout; the recipes shipped run without dropout.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from longspan.config.rules.layout import (
    check_tp_divides_heads,
    check_tp_divides_widths,
    sequence_scatter_error,
)
from longspan.core.errors import NotSupportedError
from longspan.core.logging import get_logger, warn_rank_0
from longspan.parallel import vocab_parallel_loss
from longspan.parallel.across_heads_norm import shard_across_heads_qk_norms
from longspan.parallel.gated_delta_net import (
    apply_gated_delta_net_tensor_parallel,
    is_gated_delta_net,
    lengthen_document_layouts,
)
from longspan.parallel.mamba import apply_mamba_tensor_parallel
from longspan.parallel.t5 import (
    check_t5_sequence_parallel,
    is_t5_model,
    t5_residual_dropouts,
    t5_tensor_parallel_plan,
)

_log = get_logger(__name__)

#: attribute set on a model whose logits are vocab-sharded DTensors (``parallel_loss_context`` looks for it)
LOSS_PARALLEL_ATTR = "_longspan_loss_parallel"


def check_tensor_parallel(model: nn.Module, tp: int) -> None:
    """Raise (one line) when ``model`` cannot be split ``tp`` ways by the plans of this module."""
    args = getattr(model, "args", None)
    if args is None:
        raise NotSupportedError(
            f"tensor_model_parallel_size={tp}: tensor parallel plans exist only for longspan's GPTModel, "
            f"not {type(model).__name__}"
        )
    layers = list(model.decoder.layers.values())
    has_attention = any(hasattr(layer, "self_attention") for layer in layers)  # hybrid Mamba stacks may have none
    has_mlp = any(hasattr(layer, "mlp") for layer in layers)
    if has_attention:
        check_tp_divides_heads(tp, args.num_attention_heads, args.num_query_groups)
    check_tp_divides_widths(tp, args.ffn_hidden_size if has_mlp else None, args.vocab_size)  # vocab_size: padded
    if args.share_embeddings_and_output_weights and is_t5_model(model):
        raise NotSupportedError(
            f"model.share_embeddings_and_output_weights=True with tensor_model_parallel_size={tp} is not "
            "supported for T5ModelProvider: set share_embeddings_and_output_weights=False or "
            "tensor_model_parallel_size=1"
        )


def tensor_parallel_plan(model: nn.Module, sequence_parallel: bool = False) -> dict[str, Any]:
    """The ``parallelize_module`` plan for ``model``: module name -> ParallelStyle.

    Only modules this pipeline stage holds are named (embedding on the first stage, final norm and output
    layer on the last, the layers present in ``decoder.layers``).
    """
    sp = sequence_parallel
    plan: dict[str, Any] = {}
    if getattr(model, "embedding", None) is not None:
        # The lookup's partial sums are all-reduced to a replicated output; under sp the whole sequence is then
        # cut along the sequence locally, with no communication (see _sequence_scatter_plan for where).
        plan["embedding.word_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        if sp:
            plan.update(_sequence_scatter_plan(model))
    for prefix, layer in _transformer_layers(model):
        attn, mlp = f"{prefix}.self_attention", f"{prefix}.mlp"
        attention = getattr(layer, "self_attention", None)
        if is_gated_delta_net(attention):  # shards itself by heads: apply_gated_delta_net_tensor_parallel
            attention = None
        if attention is not None and hasattr(attention, "mla"):
            plan.update(_mla_plan(attn, attention, sp))
        elif attention is not None:  # hybrid Mamba stacks: attention-only, MLP-only and Mamba layers
            plan[f"{attn}.linear_q"] = ColwiseParallel()
            if getattr(attention, "linear_gate", None) is not None:  # the output gate: per head, like the queries
                plan[f"{attn}.linear_gate"] = ColwiseParallel()
            for name in ("linear_k", "linear_v"):  # absent where a layer reuses keys (as values, or another's)
                if getattr(attention, name, None) is not None:
                    plan[f"{attn}.{name}"] = ColwiseParallel()
            plan[f"{attn}.linear_proj"] = RowwiseParallel(output_layouts=Shard(1) if sp else Replicate())
            if not getattr(attention, "qk_norm_across_heads", False):
                for name in ("q_layernorm", "k_layernorm"):
                    if getattr(attention, name, None) is not None:
                        # QK-norm runs on this rank's heads ([b, s, heads, d]): its weight is replicated and its
                        # gradient, a partial sum over local heads, must be summed over tp (dim 2 = heads). Across
                        # heads it spans the whole projection: head-sharded after the plan (across_heads_norm).
                        plan[f"{attn}.{name}"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        if hasattr(layer, "mlp") and not getattr(layer.mlp, "is_moe", False):  # MoE: parallel/expert_parallel.py
            plan[f"{mlp}.linear_fc1"] = ColwiseParallel()
            if layer.mlp.linear_fc1_gate is not None:
                plan[f"{mlp}.linear_fc1_gate"] = ColwiseParallel()
            plan[f"{mlp}.linear_fc2"] = RowwiseParallel(output_layouts=Shard(1) if sp else Replicate())
        if sp:
            for norm in ("input_layernorm", "pre_mlp_layernorm"):  # absent without layernorm_before_sublayers
                if getattr(layer, norm, None) is not None:
                    plan[f"{prefix}.{norm}"] = SequenceParallel()
            # norms after attention / the MLP (layernorm_after_sublayers): their output joins the local residual
            for norm in ("post_self_attn_layernorm", "post_mlp_layernorm"):
                if getattr(layer, norm, None) is not None:
                    plan[f"{prefix}.{norm}"] = SequenceParallel(use_local_output=True)
        # The column-wise projections share one replicated DTensor input (under sp gathered from the sequence
        # shards), so their input gradients add up as partial sums and are reduced once per sublayer (a
        # reduce-scatter under sp, an all-reduce without), Megatron's single collective, not once per projection.
        # self_attention(hidden_states, rotary, attention_mask): only the first input is laid out.
        residual = Shard(1) if sp else Replicate()
        if attention is not None and not hasattr(attention, "mla"):  # (hybrid Mamba stacks: either may be absent)
            plan[attn] = PrepareModuleInput(input_layouts=(residual, None, None),
                                            desired_input_layouts=(Replicate(), None, None), use_local_output=False)
        elif attention is not None and sp:  # MLA: its replicated down-projections take a local input
            plan[attn] = PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                            desired_input_layouts=(Replicate(), None, None), use_local_output=True)
        if hasattr(layer, "mlp") and not getattr(layer.mlp, "is_moe", False):
            plan[mlp] = PrepareModuleInput(input_layouts=(residual,), desired_input_layouts=(Replicate(),),
                                           use_local_output=False)
        elif hasattr(layer, "mlp") and sp:
            plan[mlp] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                           use_local_output=True)
    plan.update(_mtp_plan(model, sp))
    if getattr(model.decoder, "final_layernorm", None) is not None and sp:
        plan["decoder.final_layernorm"] = SequenceParallel()
    if getattr(model, "output_layer", None) is not None:
        plan["output_layer"] = ColwiseParallel(
            input_layouts=Shard(1) if sp else Replicate(), output_layouts=Shard(-1), use_local_output=False
        )
    if getattr(model, "tied_output", None) is not None:
        # tied_output(hidden_states, weight): the weight is the embedding's vocab-sharded DTensor already; the
        # hidden states become a replicated DTensor, so the matmul yields vocab-sharded logits locally.
        plan["tied_output"] = PrepareModuleInput(
            input_layouts=(Shard(1) if sp else Replicate(), None),
            desired_input_layouts=(Replicate(), None),
            use_local_output=False,
        )
    return plan


def _sequence_scatter_plan(model: nn.Module) -> dict[str, Any]:
    """Where sequence parallel cuts the whole embedded sequence into this rank's shard (Megatron's
    ``scatter_embedding_sequence_parallel``): True cuts the embedding module's output (after position embeddings
    and dropout, drawn as on one process); False keeps the embedding's output whole and cuts the decoder's input
    before the first layer, so that a caller passing ``decoder_input`` (a vision-language model's token
    embeddings with its image embeddings put in) merges on the whole sequence. A last pipeline stage's own copy
    of the embedding (multi-token prediction only) always cuts its output: its decoder input arrives cut."""
    if model.args.scatter_embedding_sequence_parallel or not model.pre_process:
        return {"embedding": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1),
                                                 use_local_output=True)}
    # decoder(hidden_states, rotary, attention_mask): only the hidden states are cut
    return {"decoder": PrepareModuleInput(input_layouts=(Replicate(), None, None),
                                          desired_input_layouts=(Shard(1), None, None), use_local_output=True)}


def _mla_plan(attn: str, module: nn.Module, sp: bool) -> dict[str, Any]:
    """Multi-latent attention, Megatron's way: the query and key/value up-projections column-wise (whole heads per
    rank), ``linear_proj`` row-wise; the down-projections and the latent norms replicated, on the full input
    (their gradients are full sums: the up-projections all-reduce their input gradients, and the shared rotary
    key's gradient is summed over ranks by ``apply_mla_shared_key``)."""
    plan: dict[str, Any] = {f"{attn}.linear_kv_up_proj": ColwiseParallel(),
                            f"{attn}.linear_proj": RowwiseParallel(output_layouts=Shard(1) if sp else Replicate())}
    if module.linear_q_proj is not None:
        plan[f"{attn}.linear_q_proj"] = ColwiseParallel()
    else:
        plan[f"{attn}.linear_q_up_proj"] = ColwiseParallel()
    return plan


def apply_mla_shared_key(model: nn.Module, tp_mesh: Any) -> None:
    """Give every multi-latent attention module of ``model`` a shared rotary key whose gradient is summed over
    the tp ranks: each rank's heads use the one replicated key, so each sees only its heads' share."""

    def shared_key(k_pe: torch.Tensor) -> torch.Tensor:
        # forward: the same tensor; backward: the local gradient is a partial sum, all-reduced to Replicate
        replicated = DTensor.from_local(k_pe, tp_mesh, (Replicate(),), run_check=False)
        return replicated.to_local(grad_placements=(Partial(),))

    for module in model.modules():
        if hasattr(module, "mla") and hasattr(module, "shared_key"):
            module.shared_key = shared_key
def _transformer_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, layer) of every transformer layer this stage holds: the decoder's, then the multi-token
    prediction depths' (their ``eh_proj`` is planned in ``_mtp_plan``)."""
    layers = [(f"decoder.layers.{key}", layer) for key, layer in model.decoder.layers.items()]
    mtp = getattr(model, "mtp", None)
    if mtp is not None:
        layers += [(f"mtp.layers.{k}.transformer_layer", depth.transformer_layer) for k, depth in enumerate(mtp.layers)]
    return layers


def _mtp_plan(model: nn.Module, sp: bool) -> dict[str, Any]:
    """The MTP depths' projections: column-parallel, gathered (megatron-core's ``eh_proj`` + gather). Without
    sequence parallel the norms stay replicated like the decoder's. With it the depth works on sequence shards
    like a decoder layer: ``enorm`` / ``hnorm`` on shards (the embedding's output is a shard already, the
    previous depth's a sharded DTensor), ``eh_proj`` gathers its input and hands its output back as a sequence
    shard (megatron-core: gather, then scatter to the sequence-parallel region), and ``final_layernorm`` gives
    the shared output layer a sharded DTensor, which it gathers as it does the decoder's."""
    mtp = getattr(model, "mtp", None)
    if mtp is None:
        return {}
    plan: dict[str, Any] = {}
    for k in range(len(mtp.layers)):
        depth = f"mtp.layers.{k}"
        if not sp:
            plan[f"{depth}.eh_proj"] = ColwiseParallel(output_layouts=Replicate())
            continue
        plan[f"{depth}.enorm"] = SequenceParallel(use_local_output=True)
        plan[f"{depth}.hnorm"] = SequenceParallel(use_local_output=True)
        plan[f"{depth}.eh_proj"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(1))
        plan[f"{depth}.final_layernorm"] = SequenceParallel()
    return plan


class SequenceShardedDropout(nn.Module):
    """Dropout on a sequence shard ``[b, s/tp, h]`` whose mask is the full-sequence one, sliced.

    The full ``[b, s, h]`` mask is drawn exactly as ``nn.Dropout`` on the whole tensor would draw it (same
    shape, dtype and generator state on every tp rank), so the result equals one process's dropout.
    """

    def __init__(self, p: float, tp_mesh: Any, sequence_dim: int = 1) -> None:
        super().__init__()
        self.p = float(p)
        self.tp_mesh = tp_mesh
        self.sequence_dim = sequence_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        tp = self.tp_mesh.size()
        full_shape = list(x.shape)
        full_shape[self.sequence_dim] *= tp
        mask = F.dropout(torch.ones(full_shape, dtype=x.dtype, device=x.device), self.p, True)
        local = mask.chunk(tp, dim=self.sequence_dim)[self.tp_mesh.get_local_rank()]
        return x * local

    def extra_repr(self) -> str:
        return f"p={self.p}, tp={self.tp_mesh.size()}"


def loss_parallel_enabled() -> bool:
    """Whether torch's ``loss_parallel()`` is active right now (its DTensor loss handlers are installed)."""
    try:  # torch internals, looked up when asked: a torch without them falls back below
        import torch.distributed.tensor.parallel.loss as tp_loss

        handlers = DTensor._op_dispatcher._custom_op_handlers
        return any(op in handlers for op in tp_loss.customized_loss_ops)
    except (AttributeError, ImportError):  # a torch without these internals: trust the caller's context
        return True


def _gather_logits_outside_loss_parallel(module: nn.Module, args: Any, output: Any) -> Any:
    """Forward hook on the output layer: outside ``loss_parallel()`` the vocab-sharded logits are gathered.

    DTensor's default cross-entropy rejects sharded logits with plain labels, so a forward outside the context
    (evaluation, a user's own loop) computes the loss on full logits: correct, just not vocab-parallel.
    """
    if loss_parallel_enabled():
        return output
    return output.full_tensor()


def _output_to_local(module: nn.Module, args: Any, output: Any) -> Any:
    """Forward hook on the root: the model returns plain tensors, not DTensors.

    The per-token loss (replicated over tp) becomes its local value; vocab-sharded logits (no labels given)
    are gathered into full logits, as a caller of the plain model expects.
    """
    if not isinstance(output, DTensor):
        return output
    if all(p.is_replicate() for p in output.placements):
        return output.to_local()
    return output.full_tensor()


def _shard_attention_sinks(model: nn.Module, tp_mesh: Any) -> None:
    """Learned attention sinks (``self_attention.softmax_offset [heads]``) split by heads like the q projection:
    each rank keeps its own heads' sinks (``Shard(0)``)."""
    from torch.distributed.tensor import distribute_tensor  # (the DTensor module is loaded already)

    for layer in model.decoder.layers.values():
        attention = getattr(layer, "self_attention", None)
        offset = getattr(attention, "softmax_offset", None)
        if offset is not None and not isinstance(offset, DTensor):
            attention.softmax_offset = nn.Parameter(distribute_tensor(offset.data, tp_mesh, [Shard(0)]),
                                                    requires_grad=offset.requires_grad)


def _is_vision_language_model(model: nn.Module) -> bool:
    """A vision-language model: a GPT language model under ``language_model`` beside its vision encoder."""
    language_model = getattr(model, "language_model", None)
    return isinstance(language_model, nn.Module) and getattr(language_model, "args", None) is not None


def _apply_vision_language_tensor_parallel(model: nn.Module, tp_mesh: Any, sequence_parallel: bool) -> nn.Module:
    """The language model is split as any GPT model; the vision encoder and its projection stay whole on every
    rank (replicated: same images in, same embeddings out, the same gradients on every rank). Under sequence
    parallel the image embeddings are put into the whole sequence's token embeddings, and the language model
    cuts that decoder input along the sequence before its first layer (``scatter_embedding_sequence_parallel``
    False); positions (mRoPE) and masks (Gemma's image blocks) stay whole-sequence, as attention sees the
    gathered sequence."""
    if sequence_parallel:
        _check_sequence_scatter(model.language_model, type(model.config).__name__, puts_images_in_sequence=True)
    apply_tensor_parallel(model.language_model, tp_mesh, sequence_parallel)
    setattr(model, LOSS_PARALLEL_ATTR, getattr(model.language_model, LOSS_PARALLEL_ATTR, False))
    return model


def _check_sequence_scatter(language_model: nn.Module, model_name: str, puts_images_in_sequence: bool) -> None:
    """Under sequence parallel: the one-line error when the language model's cut does not fit the model."""
    args = language_model.args
    error = sequence_scatter_error(model_name, args.scatter_embedding_sequence_parallel, args.mtp_num_layers,
                                   puts_images_in_sequence)
    if error is not None:
        raise error


def apply_tensor_parallel(model: nn.Module, tp_mesh: Any, sequence_parallel: bool = False) -> nn.Module:
    """Split ``model`` (on the meta device or materialized) over the 1-D ``tp_mesh`` in place; return it.

    Parameters become DTensors on ``tp_mesh``; ``init_weights`` then materializes each rank's shard from the
    full parameter's seed. Marks the model so ``parallel_loss_context(model)`` enables vocab-parallel loss.
    """
    tp = tp_mesh.size()
    if _is_vision_language_model(model):
        return _apply_vision_language_tensor_parallel(model, tp_mesh, sequence_parallel)
    check_tensor_parallel(model, tp)
    if sequence_parallel and not is_t5_model(model):
        _check_sequence_scatter(model, type(model.config).__name__, puts_images_in_sequence=False)
    mamba_plan = apply_mamba_tensor_parallel(model, tp_mesh, sequence_parallel)  # Mamba mixers: see there
    mamba_plan.update(apply_gated_delta_net_tensor_parallel(model, tp_mesh, sequence_parallel))  # and DeltaNet's
    if is_t5_model(model):  # encoder-decoder: its own plan (longspan.parallel.t5)
        if sequence_parallel:
            check_t5_sequence_parallel(model, tp)
        plan = t5_tensor_parallel_plan(model, sequence_parallel)
    else:
        plan = {**tensor_parallel_plan(model, sequence_parallel), **mamba_plan}
    for name, style in plan.items():  # an adapted layer (longspan.peft) places its adapter with its base
        adapt = getattr(model.get_submodule(name), "adapt_parallel_style", None)
        if adapt is not None:
            plan[name] = adapt(style)
    # torch's SequenceParallel re-registers the norm weights as new Parameters that always require grad, which
    # would unfreeze a frozen base (peft: the norms then train and enter the grad norm). Keep each flag as set.
    requires_grad = {name: p.requires_grad for name, p in model.named_parameters()}
    parallelize_module(model, tp_mesh, plan)
    if sequence_parallel:  # DeltaNet mixers gather the whole sequence: their documents' layout is for it
        lengthen_document_layouts(model, tp)
    _shard_attention_sinks(model, tp_mesh)
    shard_across_heads_qk_norms([getattr(layer, "self_attention", None) for _, layer in _transformer_layers(model)],
                                tp_mesh)
    apply_mla_shared_key(model, tp_mesh)
    for name, p in model.named_parameters():
        if name in requires_grad:
            p.requires_grad_(requires_grad[name])
    if sequence_parallel and model.args.hidden_dropout > 0:
        if is_t5_model(model):
            dropouts = t5_residual_dropouts(model)
        else:
            dropouts = [(layer, name) for _, layer in _transformer_layers(model)
                        for name in ("self_attn_dropout", "mlp_dropout", "dropout")  # "dropout": Mamba layers'
                        if hasattr(layer, name)]
        for layer, name in dropouts:
            setattr(layer, name, SequenceShardedDropout(model.args.hidden_dropout, tp_mesh))
    if model.args.attention_dropout > 0:
        warn_rank_0(
            f"attention_dropout={model.args.attention_dropout} under tensor parallel: its masks are drawn per rank "
            "on local heads and depend on the layout", _log,
        )
    vocab_output = getattr(model, "output_layer", None)
    if vocab_output is None:
        vocab_output = getattr(model, "tied_output", None)
    if vocab_output is not None:
        vocab_output.register_forward_hook(_gather_logits_outside_loss_parallel)
    model.register_forward_hook(_output_to_local)
    if getattr(model, "linear_cross_entropy", None) is not None:
        vocab_parallel_loss.install(model)
    setattr(model, LOSS_PARALLEL_ATTR, vocab_output is not None)
    _log.debug("tensor parallel over %d ranks (sequence_parallel=%s): %d modules", tp, sequence_parallel,
               len(plan))
    return model
