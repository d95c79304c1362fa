"""Tensor (and sequence) parallel plan for Mamba-2 mixers (``longspan.models.mamba.MambaMixer``): heads split.

As in Megatron's MambaMixer, tensor-parallel rank ``r`` of ``T`` holds and computes heads
``[r·H/T, (r+1)·H/T)`` and their groups: every segment of ``in_proj`` (``z``, ``x``, ``B``, ``C``, ``dt``),
every conv1d segment (``x``, ``B``, ``C``), ``A_log`` / ``D`` / ``dt_bias`` and the gated norm's weight are
``Shard(0)`` DTensors (a plain row split of each, since the model keeps the segments apart), ``out_proj`` is
``Shard(1)``; adapters on those projections (``longspan.peft``) are split with their base weights
(``adapter_placements``) and run on local tensors inside the mixer. The mixer reads its local shards and
derives its local head counts from their shapes, so the scan, conv and norm run on local heads only, and
parameter and optimizer memory are split too.

Communication, at the mixer's boundary (Megatron's column/row-parallel pair): without sequence parallel the
input is the replicated residual stream (backward: its gradient, a partial sum over each rank's heads, is
all-reduced) and the ``out_proj`` partial sums are all-reduced. With ``sequence_parallel`` the residual stream
is sharded along the sequence: the layer's ``norm`` runs on its shard (``SequenceParallel``), the mixer
all-gathers its input (backward: reduce-scatter) and reduce-scatters its output (backward: all-gather).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import SequenceParallel

from longspan.core.errors import ConfigError
from longspan.models.mamba import IN_PROJ_SEGMENTS

#: the mixer's parameters sharded along dim 0 (its heads' rows or channels); ``out_proj.weight`` along dim 1
ROW_SHARDED = ("in_proj.z.weight", "in_proj.x.weight", "in_proj.B.weight", "in_proj.C.weight", "in_proj.dt.weight",
               "conv1d.x.weight", "conv1d.B.weight", "conv1d.C.weight", "conv1d.x.bias", "conv1d.B.bias",
               "conv1d.C.bias", "A_log", "D", "dt_bias", "norm.weight")


def is_mamba_mixer(module: nn.Module) -> bool:
    """A Mamba-2 mixer (per-segment ``in_proj`` and the per-head ``A_log``)."""
    return hasattr(module, "local_parameters") and hasattr(module, "A_log") and hasattr(module, "in_proj")


def check_mamba_heads_split(mixer: nn.Module, ways: int, field: str) -> None:
    """Raise (one line) when ``ways`` (named by ``field``) does not divide the mixer's heads and groups."""
    if mixer.heads % ways or mixer.groups % ways:
        raise ConfigError(
            f"{field}={ways} must divide the Mamba heads ({mixer.heads}) and model.mamba_num_groups={mixer.groups}"
        )


def apply_mamba_tensor_parallel(model: nn.Module, tp_mesh: Any, sequence_parallel: bool = False) -> dict[str, Any]:
    """Shard every Mamba mixer of ``model`` by heads over ``tp_mesh`` (in place, meta or materialized).

    Returns the ``parallelize_module`` plan entries the rest of the Mamba layers need (with sequence parallel:
    each Mamba layer's ``norm`` and the stack's ``final_norm`` on sequence shards), for the caller's plan.
    """
    mixers = {name: m for name, m in model.named_modules() if is_mamba_mixer(m)}
    if not mixers:
        return {}
    tp = tp_mesh.size()
    for mixer in mixers.values():
        check_mamba_heads_split(mixer, tp, "model.tensor_model_parallel_size")
    placements = [(n, Shard(0)) for n in ROW_SHARDED] + [("out_proj.weight", Shard(1))]
    row_split = [f"in_proj.{segment}" for segment in IN_PROJ_SEGMENTS]
    for mixer in mixers.values():
        adapters = adapter_placements(mixer, row_split, ["out_proj"])
        shard_mixer_by_heads(mixer, tp_mesh, placements + adapters, sequence_parallel)
    if not sequence_parallel:
        return {}
    plan: dict[str, Any] = {name.rsplit(".", 1)[0] + ".norm": SequenceParallel(use_local_output=True)
                            for name in mixers}
    if getattr(getattr(model, "decoder", None), "final_norm", None) is not None:
        plan["decoder.final_norm"] = SequenceParallel()
    return plan


def adapter_placements(mixer: nn.Module, row_split: Iterable[str],
                       column_split: Iterable[str]) -> list[tuple[str, Any]]:
    """The placements of the adapters (``longspan.peft``) on a per-head mixer's projections, split the way their
    base weights are: a projection split by output rows (heads: ``row_split``, module paths in the mixer) keeps
    A whole and splits B (and DoRA's magnitude) by rows; one split by input columns (``column_split``) splits A by
    columns and keeps B and the magnitude whole. A group's shared A is placed where its owner holds it."""
    placements = []
    for path, rows in [(p, True) for p in row_split] + [(p, False) for p in column_split]:
        adapter = getattr(mixer.get_submodule(path), "adapter", None)
        if adapter is None:
            continue
        prefix = f"{path}.adapter"
        if adapter.linear_in is not None:  # the group's A (its other members read this one)
            placements.append((f"{prefix}.linear_in.weight", Replicate() if rows else Shard(1)))
        placements.append((f"{prefix}.linear_out.weight", Shard(0) if rows else Replicate()))
        if adapter.weight_magnitude is not None:
            placements.append((f"{prefix}.weight_magnitude", Shard(0) if rows else Replicate()))
    return placements


def shard_mixer_by_heads(mixer: nn.Module, mesh: Any, placements: list[tuple[str, Any]],
                         sequence_parallel: bool) -> None:
    """Make each named parameter of a per-head sequence mixer (Mamba's, gated DeltaNet's) a DTensor with its
    placement over ``mesh``, and hook the mixer Megatron's column/row-parallel way (see the module docstring):
    the input gathered whole (its gradient summed), the output's partial sums reduced (sp: scattered)."""
    for name, placement in placements:
        owner_name, _, attr = name.rpartition(".")
        owner = mixer.get_submodule(owner_name) if owner_name else mixer
        param = getattr(owner, attr)
        # src_data_rank=None: every rank holds the same full tensor (meta, or drawn from one seed): no scatter
        sharded = distribute_tensor(param.data, mesh, [placement], src_data_rank=None)
        owner.register_parameter(attr, nn.Parameter(sharded, requires_grad=param.requires_grad))
    residual = Shard(1) if sequence_parallel else Replicate()

    def gather_input(_module: nn.Module, args: tuple) -> tuple:
        # the whole (sequence of the) input on every rank; its gradient, each rank's heads' partial sum, is
        # summed (sp: reduce-scattered) on the way back
        whole = DTensor.from_local(args[0], mesh, [residual], run_check=False).redistribute(mesh, [Replicate()])
        return (whole.to_local(grad_placements=[Partial()]), *args[1:])

    def reduce_output(_module: nn.Module, _args: tuple, out: torch.Tensor) -> torch.Tensor:
        # out_proj's partial sums over the local heads, summed (sp: reduce-scattered along the sequence)
        return DTensor.from_local(out, mesh, [Partial()], run_check=False).redistribute(mesh, [residual]).to_local()

    mixer.register_forward_pre_hook(gather_input)
    mixer.register_forward_hook(reduce_output)
