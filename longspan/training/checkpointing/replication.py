"""Replicas of local non-persistent checkpoints on peer ranks (``checkpoint.replication``).

Ranks form cliques of ``replication_factor`` ranks spaced ``replication_jump`` apart (Megatron's clique
replication): with jump J and factor F, the ranks ``b*J*F + i + k*J`` for k in 0..F-1 are one clique. Every
rank sends the bytes of its local checkpoint file to the other members of its clique, which keep them under
``rank{R}_of{W}/replica_of_rank{P}/iter_XXXXXXX.pt``. With J the number of ranks per node, a clique spans F
nodes, so the loss of one node's local storage leaves a copy of each of its ranks' files elsewhere.

On resume a rank whose own file is gone gets it back from a clique peer holding its replica (and keeps it
again as its own file), so an iteration counts as available when every rank has it or a replica of it.
Bytes travel point to point (``isend``/``irecv``); nothing else is communicated.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from longspan.core.errors import CheckpointError, ConfigError
from longspan.core.logging import get_logger

logger = get_logger(__name__)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def replication_jump(ckpt_cfg: Any) -> int:
    """The configured jump, else the ranks per node (LOCAL_WORLD_SIZE, set by torchrun), else 1."""
    if ckpt_cfg.replication_jump is not None:
        return int(ckpt_cfg.replication_jump)
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def clique_of(rank: int, world_size: int, jump: int, factor: int) -> list[int]:
    """The ranks holding copies of ``rank``'s local checkpoint (``rank`` included), in rank order."""
    span = jump * factor
    if world_size % span:
        raise ConfigError(
            f"checkpoint.replication_jump={jump} x checkpoint.replication_factor={factor} = {span} does not divide "
            f"the world size {world_size}: choose values whose product divides it"
        )
    block, offset = divmod(rank, span)
    first = block * span + offset % jump
    return [first + k * jump for k in range(factor)]


def _clique(ckpt_cfg: Any) -> list[int]:
    return clique_of(_rank(), _world_size(), replication_jump(ckpt_cfg), int(ckpt_cfg.replication_factor))


def replica_dir(rank_dir: Path, peer: int) -> Path:
    """Where the rank owning ``rank_dir`` keeps its replicas of ``peer``'s files."""
    return rank_dir / f"replica_of_rank{peer}"


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _exchange(outgoing: dict[int, bytes]) -> dict[int, bytes]:
    """Send ``outgoing[dst]`` to each ``dst``; return what each source sent to this rank (collective)."""
    sizes = {dst: len(data) for dst, data in outgoing.items()}
    everyone: list[Any] = [None] * _world_size()
    dist.all_gather_object(everyone, sizes)
    me = _rank()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    requests, sent, received = [], [], {}
    for dst, data in sorted(outgoing.items()):
        sent.append(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device))  # alive until sent
        requests.append(dist.isend(sent[-1], dst))
    for src, their_sizes in enumerate(everyone):
        if me in their_sizes:
            received[src] = torch.empty(their_sizes[me], dtype=torch.uint8, device=device)
            requests.append(dist.irecv(received[src], src))
    for request in requests:
        request.wait()
    return {src: t.cpu().numpy().tobytes() for src, t in received.items()}


def replicate(ckpt_cfg: Any, own_file: Path) -> None:
    """Send this rank's new local checkpoint file to its clique peers and store the ones they send (collective)."""
    peers = [r for r in _clique(ckpt_cfg) if r != _rank()]
    data = own_file.read_bytes()
    received = _exchange({peer: data for peer in peers})
    for src, payload in received.items():
        _write_atomic(replica_dir(own_file.parent, src) / own_file.name, payload)


def remove_older_replicas(rank_dir: Path, keep_name: str) -> None:
    """Drop every replica file but ``keep_name`` (called once every rank holds the new iteration)."""
    for sub in rank_dir.glob("replica_of_rank*"):
        for entry in sub.iterdir():
            if entry.name != keep_name:
                entry.unlink(missing_ok=True)


def inventory(rank_dir: Path, own_iterations: list[int]) -> dict[str, Any]:
    """What this rank can supply: its own iterations and, per peer, the iterations it holds replicas of."""
    replicas: dict[int, list[int]] = {}
    for sub in rank_dir.glob("replica_of_rank*") if rank_dir.is_dir() else ():
        peer = int(sub.name.removeprefix("replica_of_rank"))
        replicas[peer] = sorted(int(p.name[5:12]) for p in sub.glob("iter_*.pt"))
    return {"own": list(own_iterations), "replicas": replicas}


def newest_recoverable_iteration(ckpt_cfg: Any, own_iterations: list[int],
                                 rank_dir: Path) -> tuple[Optional[int], list[dict[str, Any]]]:
    """The newest iteration every rank has, itself or through a clique peer's replica (collective), and every
    rank's inventory."""
    inventories: list[Any] = [None] * _world_size()
    dist.all_gather_object(inventories, inventory(rank_dir, own_iterations))
    jump, factor = replication_jump(ckpt_cfg), int(ckpt_cfg.replication_factor)
    available = []
    for rank, inv in enumerate(inventories):
        have = set(inv["own"])
        for peer in clique_of(rank, len(inventories), jump, factor):
            have |= set(inventories[peer]["replicas"].get(rank, ()))
        available.append(have)
    common = set.intersection(*available) if available else set()
    return (max(common) if common else None), inventories


def restore_missing(ckpt_cfg: Any, iteration: int, inventories: list[dict[str, Any]], rank_dir: Path) -> None:
    """Give every rank that lacks its own file of ``iteration`` the replica the lowest clique peer holds
    (collective); the receiving rank keeps it as its own file again."""
    me, world = _rank(), len(inventories)
    jump, factor = replication_jump(ckpt_cfg), int(ckpt_cfg.replication_factor)
    name = f"iter_{iteration:07d}.pt"
    outgoing = {}
    for rank, inv in enumerate(inventories):
        if iteration in inv["own"]:
            continue
        holders = [p for p in clique_of(rank, world, jump, factor)
                   if iteration in inventories[p]["replicas"].get(rank, ())]
        if holders and holders[0] == me:
            outgoing[rank] = (replica_dir(rank_dir, rank) / name).read_bytes()
    received = _exchange(outgoing)
    if iteration not in inventories[me]["own"]:
        if not received:
            raise CheckpointError(f"no replica of rank {me}'s local checkpoint {name} was found on its peers")
        _write_atomic(rank_dir / name, next(iter(received.values())))
        logger.warning(f"rank {me}: restored local checkpoint {name} from the replica of rank {next(iter(received))}")
