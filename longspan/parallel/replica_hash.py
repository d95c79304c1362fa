"""Whether data-parallel replicas still hold the same weights (``check_weight_hash_across_dp_replicas_interval``):
each rank hashes its local piece of every parameter and compares with the ranks that replicate that piece."""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist

from longspan.parallel.init import get_parallel_state


def _tensor_digest(name: str, tensor: torch.Tensor) -> bytes:
    local = tensor.detach().cpu().contiguous()
    return name.encode() + local.view(torch.uint8).numpy().tobytes()


def _replica_groups(param: torch.Tensor, dp_group: Any) -> list[tuple[str, Any]]:
    """(key, process group) of the ranks that hold the same values as this rank for ``param``.

    A plain parameter is replicated over the data-parallel group (DDP). A DTensor's local shard is replicated
    along each mesh dimension whose placement is Replicate (HSDP's dp_replicate, a TP-replicated norm weight);
    when its mesh has no data-parallel dimension, DDP replicates the whole mesh over the dp group as well.
    """
    if not hasattr(param, "to_local"):
        return [("dp", dp_group)]
    mesh = param.device_mesh
    names = mesh.mesh_dim_names or tuple(str(i) for i in range(mesh.ndim))
    groups = []
    if any(str(n) in ("ep", "etp") for n in names):  # experts: replicated over the expert data-parallel group
        groups.append(("edp", get_parallel_state().edp_group))
    elif not any(str(n).startswith("dp") for n in names):
        groups.append(("dp", dp_group))
    for i, placement in enumerate(param.placements):
        if placement.is_replicate() and mesh.size(i) > 1 and str(names[i]).startswith("dp"):
            groups.append((f"mesh:{names[i]}", mesh.get_group(i)))
    return groups


def check_param_hashes_across_dp_replicas(model: list[torch.nn.Module], dp_group: Any = None) -> bool:
    """True when every data-parallel replica holds the same values of what it replicates.

    Each rank hashes (SHA-256) its local piece of every parameter, plain or DTensor, and compares the hash
    with the ranks that replicate that piece over data parallel: the dp group for DDP (plain parameters and
    TP/CP shards alike), the dp_replicate dimension for HSDP. Pieces sharded over data parallel (FSDP2, the
    distributed optimizer) have no replica and are not compared; ``replicated_parameter_count`` tells
    whether anything was. ``dp_group`` defaults to the run's data-parallel group.
    """
    if not dist.is_initialized():
        return True
    if dp_group is None:
        dp_group = get_parallel_state().dp_group
    digests: dict[str, tuple[Any, Any]] = {}
    for chunk in model:
        for name, param in sorted(chunk.named_parameters()):
            local = param.to_local() if hasattr(param, "to_local") else param
            for key, group in _replica_groups(param, dp_group):
                if group is None or dist.get_world_size(group) < 2:
                    continue
                digest, _ = digests.setdefault(key, (hashlib.sha256(), group))
                digest.update(_tensor_digest(name, local))
    agree = True
    for key in sorted(digests):  # one fixed order on every rank: the groups of one key are disjoint
        digest, group = digests[key]
        mine = digest.hexdigest()
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, mine, group=group)
        agree = agree and all(h == mine for h in gathered)
    return agree


def replicated_parameter_count(model: list[torch.nn.Module], dp_group: Any = None) -> int:
    """How many parameters have a data-parallel replica to compare with (0: the hash check does not apply)."""
    if not dist.is_initialized():
        return 0
    if dp_group is None:
        dp_group = get_parallel_state().dp_group
    return sum(
        any(group is not None and dist.get_world_size(group) > 1 for _, group in _replica_groups(param, dp_group))
        for chunk in model
        for _, param in chunk.named_parameters()
    )
