"""Pipeline parallel stages: cut the plain GPT model into per-rank chunks (``torch.distributed.pipelining``).

T5 is cut the same way, its encoder layers followed by its decoder layers counting as one list of layers
(``longspan.models.t5.T5Model`` says what its stages exchange; ``encoder_pipeline_model_parallel_size`` gives
the encoder stages of their own, ``longspan.core.pipeline_split.t5_layer_counts``). Every T5 stage
holds the two small relative position tables; ``sync_stage_shared_grads`` sums their gradients over the stages.

Layout (Megatron's): the layers are split over ``pp × vp`` *virtual stages*; virtual stage ``s`` lives on
pipeline rank ``s % pp`` as its model chunk ``s // pp`` (torch's "loop" placement, which is Megatron's
interleaving). The V-shaped schedules of ``model.pipeline_parallel_schedule`` (ZBV, DualPipeV) place two
stages per rank instead, stage ``r`` and ``2 pp - 1 - r`` (``longspan.core.pipeline_schedules``), so rank 0
holds both ends. Stage 0 holds the embedding; the last stage holds the final norm, the output layer and the
loss. ``decoder.layers`` is keyed by the global layer index, so every chunk's parameter names are the
unpipelined model's and ``init_weights`` draws exactly the full model's weights into each chunk.

Uneven splits follow Megatron's fields: ``num_layers_in_first_pipeline_stage`` /
``num_layers_in_last_pipeline_stage`` fix the first / last pipeline rank's layer counts and the other ranks
share the rest evenly; ``account_for_embedding_in_pipeline_split`` / ``account_for_loss_in_pipeline_split``
count the embedding / loss as one layer of the first / last stage. With virtual stages each rank's count is
split evenly over its chunks.

Vision-language models (Qwen2.5-VL, Gemma 3 VL) are cut the same way: their language model's layers are the
layers split, and the vision encoder with its projection into the language model lives on stage 0 (rank 0's
first chunk), beside the embedding it feeds, as Megatron Bridge builds it on the ``pre_process`` stage;
``account_for_embedding_in_pipeline_split`` counts the embedding, not the encoder, as the layer it replaces.

Tensor and data parallel plans apply per chunk after the cut (``longspan.parallel.parallelize``), so PP
composes with TP, SP, DDP and FSDP2. A tied output layer (``share_embeddings_and_output_weights``) on a last
stage without the embedding is a copy; ``sync_tied_embedding_grads`` sums the two gradients so both copies
take the same steps (Megatron's embedding group).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from longspan.core.logging import get_logger
from longspan.core.pipeline_schedules import rank_stages, resolve_schedule
from longspan.core.pipeline_split import (  # the split arithmetic; stage_layer_counts re-exported
    layer_counts_for_config,
    stage_layer_counts,  # noqa: F401
    stage_layer_numbers,
)
from longspan.models.args import TransformerArgs
from longspan.models.builder import build_meta_model
from longspan.models.init import canonical_parameter_name
from longspan.models.t5_provider import T5ModelProvider
from longspan.parallel.parallelize import materialize_parallel_model

if TYPE_CHECKING:
    from longspan.config.schema.container import ConfigContainer

_log = get_logger(__name__)

#: attribute on every pipeline model chunk holding its ``PipelineChunkInfo``
CHUNK_INFO_ATTR = "pipeline_info"


@dataclass(frozen=True)
class PipelineChunkInfo:
    """Where one model chunk sits in the pipeline.

    Attributes:
        stage_index: the virtual stage (0 .. num_stages-1) in pipeline order.
        num_stages: ``pp × vp``.
        pp_rank, pp_size: this rank's pipeline rank and the pipeline size.
        vp_index: the chunk's index on this rank (``stage_index // pp_size``; 0 or 1 in a V shape).
        layer_numbers: the global indices of the transformer layers the chunk holds.
        activation_shape: the hidden states stages exchange, ``(micro_batch_size, local seq, hidden)``.
        activation_dtype: their dtype (``model.pipeline_dtype``).
        schedule: ``model.pipeline_parallel_schedule`` (None: 1F1B, interleaved with several chunks).
        v_shape: stages placed in a V (stage r and 2 pp - 1 - r on rank r).
    """

    stage_index: int
    num_stages: int
    pp_rank: int
    pp_size: int
    vp_index: int
    layer_numbers: tuple[int, ...]
    activation_shape: tuple[int, int, int] = (0, 0, 0)
    activation_dtype: torch.dtype = torch.float32
    schedule: str | None = None
    v_shape: bool = False

    @property
    def is_first(self) -> bool:
        """Holds the embedding."""
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        """Holds the final norm, the output layer and the loss."""
        return self.stage_index == self.num_stages - 1


class _StageParallelView:
    """``ParallelState`` as seen by the per-chunk TP/DP plans: everything delegated, the pipeline size 1.

    The TP and DP plans work on one chunk at a time over the tp/dp meshes of this pipeline rank; they have
    nothing to do with the pipeline dimension, which this layer has already handled.
    """

    def __init__(self, parallel: Any) -> None:
        self._parallel = parallel

    pp_size = 1

    def __getattr__(self, name: str) -> Any:
        return getattr(self._parallel, name)


def activation_spec(cfg: ConfigContainer) -> tuple[tuple[int, int, int], torch.dtype]:
    """Shape and dtype of the hidden states between stages: ``[micro_batch, seq / cp (/ tp with sequence
    parallel), width]`` (T5: seq is seq_length + seq_length_dec, see ``longspan.models.t5.T5Model``; width is
    the provider's ``pipeline_activation_width()``, the hidden size unless the model carries more) in
    ``model.pipeline_dtype`` (default: params_dtype; float32 with fp32_residual_connection)."""
    model = cfg.model
    seq = int(model.seq_length)
    if isinstance(model, T5ModelProvider):  # both stacks' states
        seq += int(model.seq_length_dec or 0)
    seq //= int(model.context_parallel_size or 1)
    if model.sequence_parallel:
        seq //= int(model.tensor_model_parallel_size)
    dtype = model.pipeline_dtype or model.params_dtype or torch.float32
    if model.fp32_residual_connection:
        dtype = torch.float32  # the residual stream is float32 between layers, so between stages too (Megatron)
    return (int(cfg.train.micro_batch_size), seq, model.pipeline_activation_width()), dtype


def build_pipeline_chunks(
    cfg: Any, parallel: Any, seed: int, pre_wrap_hook: Callable[[nn.Module], Any] | None = None
) -> list[nn.Module]:
    """This pipeline rank's model chunks, parallelized and initialized; each carries a ``PipelineChunkInfo``.

    ``pre_wrap_hook(chunk)`` runs on each meta-device chunk before the parallel plans (adapters: longspan.peft).

    Each chunk is built on the meta device with its layers and goes through ``materialize_parallel_model``
    (FP8 linears, the TP/DP plans, then ``init_weights`` from ``seed``: the full model's weights, by
    canonical name), as the whole model does without pipelining.
    """
    provider = cfg.model
    pp, rank = parallel.pp_size, parallel.pp_rank
    counts = layer_counts_for_config(provider, pp)
    numbers = stage_layer_numbers(counts)
    num_stages = len(counts)
    shape, dtype = activation_spec(cfg)
    name = provider.pipeline_parallel_schedule
    v_shape = resolve_schedule(name, num_stages // pp).v_shape
    chunks: list[nn.Module] = []
    for vp_index, stage in enumerate(chunk_stages(provider, pp, rank)):
        info = PipelineChunkInfo(stage, num_stages, rank, pp, vp_index, tuple(numbers[stage]), shape, dtype,
                                 name, v_shape)
        model = build_meta_model(
            provider,
            pre_process=info.is_first,
            post_process=info.is_last,
            vp_stage=vp_index if num_stages > pp else None,
            layer_numbers=list(info.layer_numbers),
        )
        model = materialize_parallel_model(model, cfg, _StageParallelView(parallel), seed, pre_wrap_hook)
        _mark_chunk(model, info, parallel)
        chunks.append(model)
    _log.debug("pipeline rank %d/%d: stages %s", rank, pp, [getattr(c, CHUNK_INFO_ATTR).stage_index for c in chunks])
    return chunks


def chunk_stages(provider: Any, pp: int, rank: int) -> list[int]:
    """The virtual stages pipeline rank ``rank`` holds, in chunk order: ``rank + k pp`` (loop placement), or
    ``rank`` and ``2 pp - 1 - rank`` under a V-shaped ``pipeline_parallel_schedule``."""
    num_stages = len(layer_counts_for_config(provider, pp))
    v_shape = resolve_schedule(provider.pipeline_parallel_schedule, num_stages // pp).v_shape
    return rank_stages(rank, pp, num_stages, v_shape)


def _mark_chunk(model: nn.Module, info: PipelineChunkInfo, parallel: Any) -> None:
    """Attach the chunk's place in the pipeline, its process groups and the tied-copy marks."""
    tied_copy = _tied_output_copy(_language_model(model)[0])
    if tied_copy is not None:
        # Megatron's mark: the gradient norm and the parameter norm count this copy once (on stage 0).
        tied_copy.weight.shared = True
        tied_copy.weight.shared_embedding = True
    for param in _mtp_embedding_copy(unwrap_chunk(model), info):
        param.shared = True
        param.shared_embedding = True
    if info.stage_index != 0:  # T5's relative position tables: every stage's copy but the first's
        for param in stage_shared_tables(unwrap_chunk(model)):
            param.shared = True
    setattr(model, CHUNK_INFO_ATTR, info)
    # Megatron's per-model process groups: the parameter-norm report sums over ``pg_collection.pp``.
    model.pg_collection = SimpleNamespace(pp=parallel.pp_group, tp=parallel.tp_group, cp=parallel.cp_group,
                                          dp=parallel.dp_group)


def unwrap_chunk(chunk: nn.Module) -> nn.Module:
    """The plain model inside a DDP wrapper (FSDP2 and TP modify the model in place)."""
    while isinstance(getattr(chunk, "module", None), nn.Module):
        chunk = chunk.module
    return chunk


def chunk_info(chunk: nn.Module) -> PipelineChunkInfo | None:
    """The ``PipelineChunkInfo`` of a chunk (on it or on the model inside its DDP wrapper), or None."""
    return getattr(chunk, CHUNK_INFO_ATTR, None) or getattr(unwrap_chunk(chunk), CHUNK_INFO_ATTR, None)


def _language_model(chunk: nn.Module) -> tuple[nn.Module, str]:
    """(the GPT model of a chunk, its name prefix): the chunk itself, or a vision-language model's
    ``language_model`` (which holds the embedding and output layer the tie is about)."""
    plain = unwrap_chunk(chunk)
    inner = getattr(plain, "language_model", None)
    if isinstance(inner, nn.Module) and hasattr(inner, "share_embeddings_and_output_weights"):
        return inner, "language_model."
    return plain, ""


def _tied_output_copy(model: nn.Module) -> nn.Linear | None:
    """The output layer of a last stage that holds a copy of the (tied) word embeddings, if any."""
    output = getattr(model, "output_layer", None)
    overrides = getattr(output, "init_name_overrides", None) if output is not None else None
    if overrides and overrides.get("weight") == "embedding.word_embeddings.weight":
        return output
    return None


def _mtp_embedding_copy(model: nn.Module, info: PipelineChunkInfo) -> list[torch.Tensor]:
    """The embedding parameters a last stage with multi-token prediction holds as a copy of the first
    stage's (word, then position embeddings), or [] (no MTP, or one stage holds both)."""
    if getattr(model, "mtp", None) is None or info.is_first or getattr(model, "embedding", None) is None:
        return []
    return _embedding_params(model)


def _embedding_params(model: nn.Module) -> list[torch.Tensor]:
    embedding = model.embedding
    params = [embedding.word_embeddings.weight]
    if embedding.position_embeddings is not None:
        params.append(embedding.position_embeddings.weight)
    return params


def _has_mtp(model: list[nn.Module]) -> bool:
    return any(getattr(unwrap_chunk(c), "mtp", None) is not None or _mtp_depths(unwrap_chunk(c)) for c in model)


def _mtp_depths(chunk: nn.Module) -> int | None:
    """A GPT chunk's multi-token-prediction depths (its ``TransformerArgs``); None for other models."""
    args = getattr(chunk, "args", None)  # a module attribute: T5's are T5Args, a vision-language model has none
    return args.mtp_num_layers if isinstance(args, TransformerArgs) else None


def tied_embedding_weights(model: list[nn.Module]) -> list[torch.Tensor]:
    """This rank's tied embedding tensors that must stay equal across pipeline stages (empty when untied).

    The first stage's word embeddings and the last stage's output copy, when the model ties them and they
    are on different stages.
    """
    out = []
    for chunk in model:
        plain = _language_model(chunk)[0]
        info = chunk_info(chunk)
        if _has_mtp(model) and info is not None and info.num_stages > 1:
            # multi-token prediction: the last stage's embedding copy (untied models only: config rules)
            if info.is_first or _mtp_embedding_copy(plain, info):
                out.extend(_embedding_params(plain))
            continue
        if not getattr(plain, "share_embeddings_and_output_weights", False):
            continue
        if info is None or info.num_stages == 1:
            continue
        if info.is_first and plain.embedding is not None:
            out.append(plain.embedding.word_embeddings.weight)
        if info.is_last and _tied_output_copy(plain) is not None:
            out.append(plain.output_layer.weight)
    return out


def _embedding_group(parallel: Any) -> Any:
    """The embedding process group of this rank (created collectively, once per set of ranks and world).

    The groups are kept in ``parallel.extra_groups``, which ``destroy_distributed`` empties: after an
    in-process restart the new world creates its own.
    """
    groups = parallel.extra_groups
    mesh = parallel.mesh
    names = mesh.mesh_dim_names
    pp_dim = names.index("pp")
    # Every rank must create every group, in the same order: walk all pipeline groups of the mesh.
    full = mesh.mesh.movedim(pp_dim, -1).reshape(-1, mesh.mesh.shape[pp_dim])
    mine = None
    for row in full.tolist():
        key = ("embedding", row[0], row[-1])
        if key not in groups:
            groups[key] = dist.new_group([row[0], row[-1]])
        if dist.get_rank() in row:
            mine = groups[key]
    return mine


def stage_shared_tables(model: nn.Module) -> list[torch.Tensor]:
    """Parameters every pipeline stage of ``model`` holds a copy of (T5's relative position tables, in a
    fixed order), or []."""
    tables = [getattr(model, name, None) for name in ("encoder_relative_pos_emb", "decoder_relative_pos_emb")]
    return [table.relative_attention_bias.weight for table in tables if table is not None]


def sync_stage_shared_grads(model: list[nn.Module], parallel: Any) -> None:
    """Sum the gradients of the parameters every stage holds a copy of (``stage_shared_tables``) over this
    rank's chunks and the pipeline group, into every copy: the copies take the steps one tensor would."""
    per_chunk = [stage_shared_tables(unwrap_chunk(chunk)) for chunk in model]
    if parallel.pp_size == 1 or not per_chunk[0]:
        return
    for copies in zip(*per_chunk):
        grads = []
        for weight in copies:
            if weight.grad is None:
                weight.grad = torch.zeros_like(weight)
            grads.append(weight.grad.to_local() if hasattr(weight.grad, "to_local") else weight.grad)
        total = torch.stack(grads).sum(0)
        dist.all_reduce(total, group=parallel.pp_group)
        for grad in grads:
            grad.copy_(total)


def sync_tied_embedding_grads(model: list[nn.Module], parallel: Any) -> None:
    """Sum the gradients of the tied word embeddings (first stage) and output copy (last stage).

    Both copies then take identical optimizer steps, as one shared tensor does on one process. A no-op
    when nothing is tied across stages. Collective over the embedding group of every pipeline.
    """
    if parallel.pp_size == 1:
        return
    sync_stage_shared_grads(model, parallel)
    tied = tied_embedding_weights(model)
    provider_ties = any(getattr(_language_model(c)[0], "share_embeddings_and_output_weights", False) for c in model)
    if not provider_ties and not _has_mtp(model):
        return
    group = _embedding_group(parallel)
    if parallel.pp_rank not in (0, parallel.pp_size - 1):
        return
    for weight in tied:
        grad = weight.grad
        if grad is None:
            grad = weight.grad = torch.zeros_like(weight)
        if hasattr(grad, "to_local") and tuple(grad.placements) != tuple(weight.placements):
            # Under tensor parallel the lookup's gradient comes back replicated while the output copy's is
            # vocab-sharded like its weight: lay both out as their weights (a local slice, no communication)
            # so the two stages reduce the same vocabulary rows.
            grad = weight.grad = grad.redistribute(weight.device_mesh, weight.placements)
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        dist.all_reduce(local, group=group)


def state_dict_module(model: list[nn.Module]) -> nn.Module:
    """One module whose ``named_parameters()`` are every chunk's parameters under the unpipelined names.

    The very same Parameter objects are registered (checkpointing maps optimizer state to names by
    identity and loads into them in place). A tied output copy on a last stage without the embedding is
    registered as ``embedding.word_embeddings.weight``, the one tensor an unpipelined tied model has, so
    checkpoints move between layouts. A single chunk without such a copy is returned as it is.
    """
    plains = [unwrap_chunk(chunk) for chunk in model]
    copies = {}
    for lm, prefix in map(_language_model, plains):
        if getattr(lm, "embedding", None) is None and _tied_output_copy(lm) is not None:
            copies[id(lm.output_layer.weight)] = prefix + "embedding.word_embeddings.weight"
    if len(model) == 1 and not copies:
        return model[0]
    root = nn.Module()
    seen: set[int] = set()
    # later chunks' copies of the stage-shared tables are the same values (synced gradients): one name each
    later_copies = {id(p) for plain in plains[1:] for p in stage_shared_tables(plain)}
    for plain in plains:
        for name, param in plain.named_parameters():
            if id(param) in seen or id(param) in later_copies:
                continue
            seen.add(id(param))
            name = copies.get(id(param)) or canonical_parameter_name(name)
            *path, leaf = name.split(".")
            module = root
            for part in path:
                if part not in module._modules:
                    module.add_module(part, nn.Module())
                module = module._modules[part]
            if leaf in module._parameters:
                raise ValueError(f"parameter {name} appears in two pipeline chunks")
            module.register_parameter(leaf, param)
    return root
