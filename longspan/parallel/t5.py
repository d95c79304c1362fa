"""Tensor, sequence and context parallel plans for longspan's ``T5Model`` (``longspan.models.t5``), applied like the GPT plan.

Megatron's split, per stack: attention ``linear_q`` / ``linear_k`` / ``linear_v`` column-wise (whole heads per
rank; the cross-attention's k/v read the replicated encoder output) and ``linear_proj`` row-wise; MLP
``linear_fc1`` / ``linear_fc1_gate`` column-wise and ``linear_fc2`` row-wise; the shared word embeddings
row-wise (vocab-sharded); the untied ``output_layer`` column-wise with vocab-sharded logits for the
vocab-parallel loss; each relative position table ``[buckets, heads]`` column-wise, so every rank looks up
the bias of its own heads. Norms and learned position embeddings stay replicated.

With ``sequence_parallel`` the residual streams of both stacks are split along the sequence (dim 1), as in
the GPT plan: the embedding dropout's output is cut locally, norms run on their shard (``SequenceParallel``),
the inputs of attention and MLP are all-gathered and ``linear_proj`` / ``linear_fc2`` reduce-scatter back to
shards. The encoder output stays sequence-sharded; every cross-attention all-gathers it for its keys and
values (megatron-core does the same per layer). The residual dropouts draw the full-sequence mask and keep
their slice (``SequenceShardedDropout``), so losses do not depend on the layout.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

from longspan.core.errors import ConfigError, NotSupportedError
from longspan.models.t5 import Attention, SequenceSlice, T5Model, biased_attention
from longspan.parallel.context_parallel import CONTEXT_PARALLEL_ATTR, gather_sequence, load_balanced_indices


def is_t5_model(model: nn.Module) -> bool:
    """Whether ``model`` is longspan's T5 encoder-decoder (planned here, not by the GPT plan)."""
    return isinstance(model, T5Model)


def t5_tensor_parallel_plan(model: T5Model, sequence_parallel: bool = False) -> dict[str, Any]:
    """The ``parallelize_module`` plan for a T5 model: module name -> ParallelStyle (see the module docstring)."""
    sp = sequence_parallel
    plan: dict[str, Any] = {}
    if model.embedding is not None:  # the first pipeline stage (or the whole model)
        plan["embedding.word_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if sp:  # the embeddings (after position embeddings and dropout, drawn as on one process) cut locally
        plan["embedding_dropout"] = PrepareModuleOutput(
            output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=True
        )
    for table in ("encoder_relative_pos_emb", "decoder_relative_pos_emb"):
        if getattr(model, table, None) is not None:
            plan[f"{table}.relative_attention_bias"] = ColwiseParallel(input_layouts=Replicate())
    for stack_name in ("encoder", "decoder"):
        for key, layer in getattr(model, stack_name).layers.items():
            plan.update(_layer_plan(f"{stack_name}.layers.{key}", layer, sp))
    if sp:  # (sequence parallel T5 runs without pipeline stages: every part is here)
        # The encoder output leaves as this rank's sequence shard; each cross-attention gathers it.
        plan["encoder.final_layernorm"] = SequenceParallel(use_local_output=True)
        plan["decoder.final_layernorm"] = SequenceParallel()
    if model.output_layer is not None:
        plan["output_layer"] = ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(),
                                               output_layouts=Shard(-1), use_local_output=False)
    return plan


def _layer_plan(prefix: str, layer: nn.Module, sp: bool) -> dict[str, Any]:
    """One encoder or decoder layer: the column/row pairs, and under sequence parallel its norms on sequence
    shards and the inputs of attention (the query side, and the encoder output of cross-attention) and of the
    MLP gathered along the sequence."""
    plan: dict[str, Any] = {}
    attentions = ["self_attention"] + (["cross_attention"] if layer.cross_attention is not None else [])
    for attn in attentions:
        for name in ("linear_q", "linear_k", "linear_v"):
            plan[f"{prefix}.{attn}.{name}"] = ColwiseParallel()
        if getattr(layer, attn).q_layernorm is not None:
            # QK-norm on this rank's heads ([b, s, heads, d]): replicated weight, gradient summed over tp
            for norm in ("q_layernorm", "k_layernorm"):
                plan[f"{prefix}.{attn}.{norm}"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan[f"{prefix}.{attn}.linear_proj"] = RowwiseParallel(output_layouts=Shard(1) if sp else Replicate())
    plan[f"{prefix}.mlp.linear_fc1"] = ColwiseParallel()
    if layer.mlp.linear_fc1_gate is not None:
        plan[f"{prefix}.mlp.linear_fc1_gate"] = ColwiseParallel()
    plan[f"{prefix}.mlp.linear_fc2"] = RowwiseParallel(output_layouts=Shard(1) if sp else Replicate())
    if not sp:
        return plan
    norms = ["input_layernorm", "pre_mlp_layernorm"] + (["pre_cross_attn_layernorm"] if len(attentions) > 1 else [])
    for norm in norms:  # local shards out (the residual may start from them), gathered by the modules below
        plan[f"{prefix}.{norm}"] = SequenceParallel(use_local_output=True)
    # self_attention(hidden, bias); cross_attention(hidden, bias, encoder_output); mlp(hidden)
    plan[f"{prefix}.self_attention"] = PrepareModuleInput(
        input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None), use_local_output=True
    )
    if len(attentions) > 1:
        plan[f"{prefix}.cross_attention"] = PrepareModuleInput(
            input_layouts=(Shard(1), None, Shard(1)), desired_input_layouts=(Replicate(), None, Replicate()),
            use_local_output=True,
        )
    plan[f"{prefix}.mlp"] = PrepareModuleInput(
        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
    )
    return plan


def t5_residual_dropouts(model: T5Model) -> list[tuple[nn.Module, str]]:
    """(layer, attribute) of every dropout on the residual stream of a T5 layer (self-attention, cross-attention
    and MLP outputs): under sequence parallel they act on sequence shards."""
    found = []
    for stack in (model.encoder, model.decoder):
        for layer in stack.layers.values():
            for name in ("self_attn_dropout", "cross_attn_dropout", "mlp_dropout"):
                if hasattr(layer, name):
                    found.append((layer, name))
    return found


def check_t5_sequence_parallel(model: T5Model, tp: int) -> None:
    """Sequence parallel splits the encoder and the decoder sequences over ``tp`` ranks: both must divide."""
    for field in ("seq_length", "seq_length_dec"):
        length = getattr(model.config, field)
        if length % tp:
            raise ConfigError(
                f"model.{field}={length} must be a multiple of model.tensor_model_parallel_size={tp} with "
                "model.sequence_parallel=True"
            )


# ------------------------------------------------------------------------------------- context parallel

_T5_FORWARD_ARGS = ("encoder_input_ids", "decoder_input_ids", "encoder_attn_mask", "decoder_attn_mask",
                    "encoder_decoder_attn_mask", "lm_labels")


class T5ContextParallelAttention:
    """Drop-in ``Attention.core_attention`` for T5 under context parallel: this rank's queries attend to the
    whole sequence's keys and values, all-gathered over ``group`` (backward: the matching reduce-scatter).
    The bias holds this rank's query rows and every key column (``T5Model`` builds it from the slices)."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, dropout_p: float,
                 scale: float | None) -> torch.Tensor:
        k_full = gather_sequence(k, self.group, seq_dim=2)
        v_full = gather_sequence(v, self.group, seq_dim=2)
        return biased_attention(q, k_full, v_full, bias, dropout_p, scale)

    def __repr__(self) -> str:
        return "T5ContextParallelAttention(all-gather K/V)"


def _query_rows(mask: torch.Tensor | None, idx: torch.Tensor) -> torch.Tensor | None:
    """A mask's rows of this rank's queries; a mask broadcast over queries (one row) is kept as is."""
    if mask is None or mask.dim() < 2 or mask.shape[-2] == 1:
        return mask
    return mask.index_select(-2, idx)


def _slice_t5_inputs(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Forward pre-hook: keep this rank's load-balanced chunks of the full-length encoder and decoder inputs
    (ids, mask rows, labels) and tell the model which global positions they are."""
    group = getattr(module, CONTEXT_PARALLEL_ATTR)
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    if len(args) > len(_T5_FORWARD_ARGS):
        raise TypeError(f"T5Model.forward takes at most {len(_T5_FORWARD_ARGS)} positional arguments")
    kwargs = {**kwargs, **dict(zip(_T5_FORWARD_ARGS, args))}
    if kwargs.get("encoder_hidden_states") is not None:
        raise NotSupportedError("T5Model(encoder_hidden_states=...) under context parallel is not supported: "
                                "run generation with context_parallel_size=1")
    for stack, ids_key, masks in (("encoder", "encoder_input_ids", ("encoder_attn_mask",)),
                                  ("decoder", "decoder_input_ids", ("decoder_attn_mask", "encoder_decoder_attn_mask"))):
        ids = kwargs[ids_key]
        idx = load_balanced_indices(ids.shape[1], cp, rank, device=ids.device)
        kwargs[f"{stack}_slice"] = SequenceSlice(idx, ids.shape[1])
        kwargs[ids_key] = ids.index_select(1, idx)
        for name in masks:
            kwargs[name] = _query_rows(kwargs.get(name), idx)
        if stack == "decoder" and kwargs.get("lm_labels") is not None:
            kwargs["lm_labels"] = kwargs["lm_labels"].index_select(1, idx)
    return (), kwargs


def _gather_t5_outputs(module: nn.Module, args: tuple, kwargs: dict, output: torch.Tensor) -> torch.Tensor:
    """Forward hook: the decoder's per-token losses (or logits) back to the full sequence, in order."""
    if isinstance(output, DTensor):
        output = output.full_tensor()
    return gather_sequence(output, getattr(module, CONTEXT_PARALLEL_ATTR), seq_dim=1)


def apply_t5_context_parallel(model: T5Model, group: Any) -> T5Model:
    """Context parallel for T5 over ``group`` (after tensor parallel, before data parallel), as
    ``longspan.parallel.context_parallel`` does for GPT: the encoder and the decoder sequences are each split
    into load-balanced chunks; every attention core (encoder and decoder self-attention, cross-attention over
    the encoder output) gathers the whole sequence's keys and values; the model takes full-length inputs and
    returns full-length per-token losses, so the forward step and the loss are those of one process."""
    if group is None or dist.get_world_size(group) == 1 or getattr(model, CONTEXT_PARALLEL_ATTR, None) is group:
        return model
    core = T5ContextParallelAttention(group)
    for module in model.modules():
        if isinstance(module, Attention):
            module.core_attention = core
    setattr(model, CONTEXT_PARALLEL_ATTR, group)
    model.register_forward_pre_hook(_slice_t5_inputs, with_kwargs=True)
    model.register_forward_hook(_gather_t5_outputs, with_kwargs=True)
    return model
