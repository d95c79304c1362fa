"""Tensor parallel plan for longspan's ``T5Model`` (``longspan.models.t5``), applied like the GPT plan.

Megatron's split, per stack: attention ``linear_q`` / ``linear_k`` / ``linear_v`` column-wise (whole heads per
rank; the cross-attention's k/v read the replicated encoder output) and ``linear_proj`` row-wise; MLP
``linear_fc1`` / ``linear_fc1_gate`` column-wise and ``linear_fc2`` row-wise; the shared word embeddings
row-wise (vocab-sharded); the untied ``output_layer`` column-wise with vocab-sharded logits for the
vocab-parallel loss; each relative position table ``[buckets, heads]`` column-wise, so every rank looks up
the bias of its own heads. Norms and learned position embeddings stay replicated. Sequence parallel is not
supported for T5 yet.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from longspan.core.errors import NotSupportedError
from longspan.models.t5 import T5Model


def is_t5_model(model: nn.Module) -> bool:
    """Whether ``model`` is longspan's T5 encoder-decoder (planned here, not by the GPT plan)."""
    return isinstance(model, T5Model)


def t5_tensor_parallel_plan(model: T5Model, sequence_parallel: bool = False) -> dict[str, Any]:
    """The ``parallelize_module`` plan for a T5 model: module name -> ParallelStyle."""
    if sequence_parallel:
        raise NotSupportedError(
            "model.sequence_parallel=True is not supported yet for T5ModelProvider: set it to False"
        )
    plan: dict[str, Any] = {
        "embedding.word_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
    }
    for table in ("encoder_relative_pos_emb", "decoder_relative_pos_emb"):
        if getattr(model, table, None) is not None:
            plan[f"{table}.relative_attention_bias"] = ColwiseParallel(input_layouts=Replicate())
    for stack_name in ("encoder", "decoder"):
        stack = getattr(model, stack_name)
        for key, layer in stack.layers.items():
            prefix = f"{stack_name}.layers.{key}"
            attentions = ["self_attention"] + (["cross_attention"] if layer.cross_attention is not None else [])
            for attn in attentions:
                for name in ("linear_q", "linear_k", "linear_v"):
                    plan[f"{prefix}.{attn}.{name}"] = ColwiseParallel()
                plan[f"{prefix}.{attn}.linear_proj"] = RowwiseParallel()
            plan[f"{prefix}.mlp.linear_fc1"] = ColwiseParallel()
            if layer.mlp.linear_fc1_gate is not None:
                plan[f"{prefix}.mlp.linear_fc1_gate"] = ColwiseParallel()
            plan[f"{prefix}.mlp.linear_fc2"] = RowwiseParallel()
    if model.output_layer is not None:
        plan["output_layer"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    return plan
