"""The frozen teacher of a distillation run: built with the student's layout, loaded, and run beside it.

``build_teacher(cfg, parallel)`` builds the teacher's model chunks the way training builds the student's
(``training.setup.build_model``: the same tensor, context, data (DDP / FSDP2) and pipeline plans, the student's
layout and precision fields copied onto the teacher's provider), loads its weights (an HF model directory or a
longspan checkpoint), then freezes it (``requires_grad`` off, eval mode; it only ever runs under no-grad).

What the student's loss needs of the teacher is its final hidden states (taken where its own loss would be
computed, so no teacher logits are formed) and its output projection: a plain copy of this rank's vocabulary
rows is kept (``output_weight``), because FSDP2 frees a sharded weight's gathered copy after the forward that
used it and the student's backward recomputes the teacher's logits chunk by chunk.

Pipeline parallel: rank r holds the teacher's stage r beside the student's. The teacher's hidden states go from
stage to stage on a process group of their own (same ranks as the pipeline group), sent when a stage's forward
step runs and received by the next stage's forward step for the same microbatch (every stage runs its
microbatches in order under 1F1B and GPipe); torch's schedule exchanges only the student's activations.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from longspan.conversion import is_hf_model_dir
from longspan.conversion.bridge import AutoBridge
from longspan.core.errors import ConfigError, NotSupportedError
from longspan.core.logging import get_logger, print_rank_0
from longspan.core.model_parallel_config import PARALLEL_CONFIG_FIELDS
from longspan.parallel.pipeline import activation_spec, chunk_info, unwrap_chunk
from longspan.training.checkpointing.model_loading import load_model_weights, resolve_checkpoint_dir
from longspan.training.distill.kd_loss import replicated_hidden
from longspan.training.setup import build_model

logger = get_logger(__name__)


@dataclass
class Teacher:
    """A built, loaded, frozen teacher on this rank."""

    chunks: list[nn.Module]
    """This rank's teacher model chunks (one; pipeline stage r on pipeline rank r)."""
    cfg: Any
    """The config the teacher was built from (the student's, with the teacher's provider)."""
    output_weight: Optional[torch.Tensor] = None
    """The last stage's copy of this rank's vocabulary rows of the teacher's output projection (None elsewhere)."""
    relay: Optional["HiddenRelay"] = None
    """Hands the teacher's hidden states from stage to stage (None without pipeline parallel)."""
    captured: list[torch.Tensor] = field(default_factory=list)
    """The final hidden states of the teacher's last forward, waiting for the student's loss."""


def teacher_config(cfg: Any) -> Any:
    """The student's config with the teacher's provider as its model; the teacher's layout and precision fields
    (``ModelParallelConfig``'s) and ``seq_length`` are the student's: the two run side by side."""
    student = cfg.model
    teacher = copy.deepcopy(student.teacher)
    for name in PARALLEL_CONFIG_FIELDS:
        if hasattr(student, name):
            setattr(teacher, name, getattr(student, name))
    teacher.seq_length = student.seq_length
    if hasattr(teacher, "finalize"):
        teacher.finalize()
    out = copy.copy(cfg)
    out.model = teacher
    out.peft = None
    return out


def check_teacher_fits(student: Any, teacher: Any) -> None:
    """One-line errors for a teacher the student cannot be distilled from."""
    if teacher.vocab_size is not None and student.vocab_size is not None:
        if int(teacher.vocab_size) != int(student.vocab_size):
            raise ConfigError(
                f"model.teacher.vocab_size={teacher.vocab_size} differs from the student's model.vocab_size="
                f"{student.vocab_size}: the KL loss compares the two models' distributions token by token, so "
                "the teacher must use the student's tokenizer and vocabulary"
            )
        if int(teacher.padded_vocab_size) != int(student.padded_vocab_size):
            raise ConfigError(
                f"model.teacher.make_vocab_size_divisible_by={teacher.make_vocab_size_divisible_by} pads the "
                f"teacher's vocabulary to {teacher.padded_vocab_size} rows, the student's to "
                f"{student.padded_vocab_size}: use the student's make_vocab_size_divisible_by="
                f"{student.make_vocab_size_divisible_by}"
            )
    for name, provider in (("model", student), ("model.teacher", teacher)):
        if provider.mtp_num_layers:
            raise NotSupportedError(f"{name}.mtp_num_layers={provider.mtp_num_layers} is not supported with "
                                    "distillation yet: set it to null")
        if provider.final_logit_softcapping:
            raise NotSupportedError(f"{name}.final_logit_softcapping={provider.final_logit_softcapping} is not "
                                    "supported with distillation yet")
    vp = student.virtual_pipeline_model_parallel_size
    if vp is not None and int(vp) > 1:
        raise NotSupportedError(f"model.virtual_pipeline_model_parallel_size={vp} is not supported with "
                                "distillation yet (as in Megatron Bridge): use one model chunk per pipeline rank")
    schedule = student.pipeline_parallel_schedule
    if schedule not in (None, "1F1B", "GPipe"):
        raise NotSupportedError(f"model.pipeline_parallel_schedule={schedule!r} is not supported with distillation "
                                "yet: use null (1F1B) or 'GPipe'")


def build_teacher(cfg: Any, parallel: Any) -> Teacher:
    """Build, load and freeze the teacher of ``cfg.model`` (a ``DistillationProvider``) on this rank."""
    path = cfg.model.teacher_checkpoint
    if not path:
        raise ConfigError("distillation needs the teacher's weights: convert_to_distillation_provider(..., "
                          "teacher_checkpoint=DIR) with an HF model directory or a longspan checkpoint")
    tcfg = teacher_config(cfg)
    check_teacher_fits(cfg.model, tcfg.model)
    chunks = build_model(tcfg, parallel, cfg.rng.seed)
    _load_weights(path, chunks)
    for chunk in chunks:
        for param in chunk.parameters():
            param.requires_grad_(False)
        chunk.eval()
    teacher = Teacher(chunks, tcfg)
    info = chunk_info(chunks[0])
    if info is None or info.is_last:
        teacher.output_weight = _local_vocab_rows(unwrap_chunk(chunks[0]).output_weight(), parallel)
    if parallel.pp_size > 1:
        shape, dtype = activation_spec(tcfg)
        teacher.relay = HiddenRelay(parallel, shape, dtype)
    _capture_hidden(unwrap_chunk(chunks[0]), teacher)
    return teacher


def _load_weights(path: str, chunks: list[nn.Module]) -> None:
    if is_hf_model_dir(Path(path)):
        count = AutoBridge.from_hf_pretrained(path).load_weights_into(chunks)
        print_rank_0(f"distillation: teacher weights from HF directory {path} ({count} tensors)", logger)
        return
    directory, iteration = resolve_checkpoint_dir(path)
    load_model_weights(directory, chunks)
    print_rank_0(f"distillation: teacher weights from checkpoint {directory} (iteration {iteration})", logger)


def _local_vocab_rows(weight: torch.Tensor, parallel: Any) -> torch.Tensor:
    """A plain copy of this tensor-parallel rank's rows of an output weight (gathered from FSDP2 shards)."""
    with torch.no_grad():
        full = weight.full_tensor() if isinstance(weight, DTensor) else weight.detach()
        tp = parallel.tp_size
        if tp > 1:
            rows = full.shape[0] // tp
            rank = dist.get_rank(parallel.tp_group)
            full = full[rank * rows:(rank + 1) * rows]
        return full.clone()


def _capture_hidden(model: nn.Module, teacher: Teacher) -> None:
    """Make the teacher's last stage keep its final hidden states instead of computing a loss on them."""

    def keep_hidden(hidden_states: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        teacher.captured.append(replicated_hidden(hidden_states).detach())
        return torch.zeros(labels.shape, dtype=torch.float32, device=labels.device)

    model._output_loss = keep_hidden


class HiddenRelay:
    """The teacher's hidden states from pipeline stage r to r + 1, on a process group of their own."""

    def __init__(self, parallel: Any, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.group = _teacher_pipeline_group(parallel)
        ranks = dist.get_process_group_ranks(parallel.pp_group)
        rank = parallel.pp_rank
        self.prev = ranks[rank - 1] if rank > 0 else None
        self.next = ranks[rank + 1] if rank + 1 < len(ranks) else None
        self.shape, self.dtype, self.device = shape, dtype, parallel.device
        self.pending: list[tuple[Any, torch.Tensor]] = []

    def send(self, hidden: torch.Tensor) -> None:
        """Start sending a microbatch's hidden states to the next stage (kept alive until delivered)."""
        self.pending = [(work, t) for work, t in self.pending if not work.is_completed()]
        if isinstance(hidden, DTensor):
            hidden = hidden.to_local()
        tensor = hidden.detach().to(self.dtype).contiguous()
        self.pending.append((dist.isend(tensor, self.next, group=self.group), tensor))

    def recv(self) -> torch.Tensor:
        """The previous stage's hidden states of the microbatch this stage runs next."""
        tensor = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        dist.recv(tensor, self.prev, group=self.group)
        return tensor


def _teacher_pipeline_group(parallel: Any) -> Any:
    """This rank's copy of its pipeline group (created collectively: every rank creates every group, in order)."""
    groups = parallel.extra_groups
    mesh = parallel.mesh
    pp_dim = mesh.mesh_dim_names.index("pp")
    rows = mesh.mesh.movedim(pp_dim, -1).reshape(-1, mesh.mesh.shape[pp_dim]).tolist()
    mine = None
    for row in rows:
        key = ("distill_teacher", *row)
        if key not in groups:
            groups[key] = dist.new_group(row)
        if dist.get_rank() in row:
            mine = groups[key]
    return mine
