"""Asynchronous ``torch_dist`` saves (``checkpoint.async_save``): DCP writes in a background thread while training
goes on; the directory is renamed into place and the tracker written only once every rank has finished.

DCP's background thread runs collectives of its own (the save plan's gather and scatter, the metadata gather).
On the process group the training loop uses they would interleave with the main thread's collectives: gloo
pairs messages by their order on a group, not by thread, so a training all-reduce lands in the save's
``gather_object`` (which then tries to allocate exabytes) or both sides wait forever. The background save
therefore runs on a gloo group of its own (``checkpoint_process_group``), which nothing else uses.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter

from longspan.config.schema.training import CheckpointConfig
from longspan.parallel.init import on_destroy_distributed

# (default group, its checkpoint group): a new default group (a re-initialized world) gets a new one.
_checkpoint_group: tuple[Any, Any] | None = None
# Futures of background saves not yet completed, for a process that tears its process groups down and trains
# again (in-process restart): their threads must be done before the groups go and a new save may reuse the path.
_in_flight: list[Any] = []


def checkpoint_process_group() -> Any:
    """The gloo group of every rank that background saves use (None without torch.distributed).

    Made on first use; creating a group is collective, so every rank must first call this at the same point
    (the first async save, which every rank makes).
    """
    global _checkpoint_group
    if not dist.is_initialized():
        return None
    default = dist.distributed_c10d._get_default_group()
    if _checkpoint_group is None or _checkpoint_group[0] is not default:
        _checkpoint_group = (default, dist.new_group(backend="gloo"))
    return _checkpoint_group[1]


@on_destroy_distributed
def _forget_checkpoint_group() -> None:
    """The world is being torn down: drop its checkpoint group (and the default group it was made for)."""
    global _checkpoint_group
    _checkpoint_group = None


@dataclass
class PendingAsyncSave:
    """A background save: its future, its iteration and what completes it (rename, side files, tracker)."""

    future: Any
    iteration: int
    finalize: Callable[[], None]
    started: float = field(default_factory=time.time)


def dcp_save_arguments(directory: Path, ckpt_cfg: CheckpointConfig) -> dict[str, Any]:
    """The writer and planner of a save: ``storage_writers_per_rank`` threads (and as many files) per rank, the
    save plan cached across saves when ``ckpt_assume_constant_structure``."""
    threads = int(ckpt_cfg.storage_writers_per_rank or 1)
    writer = FileSystemWriter(str(directory), thread_count=threads)
    planner = DefaultSavePlanner(enable_plan_caching=bool(ckpt_cfg.ckpt_assume_constant_structure))
    # DCP caches plans per key, class-wide: one key per checkpoint root, so another run in this process (another
    # model) never meets this run's plans.
    planner._cached_plans_key = plan_cache_key(directory.parent)
    return {"checkpoint_id": str(directory), "storage_writer": writer, "planner": planner}


def plan_cache_key(root: Path) -> str:
    """The key DCP caches the save plans of checkpoints under ``root`` with."""
    return f"longspan:{Path(root).resolve()}"


def start_async_save(state_dict: dict[str, Any], directory: Path, iteration: int,
                     finalize: Callable[[], None], ckpt_cfg: CheckpointConfig) -> PendingAsyncSave:
    """Stage ``state_dict`` (a copy, so training may change the tensors right away) and write it to
    ``directory`` in the background; ``finalize_async_saves`` completes it with ``finalize``."""
    target = dcp_save_arguments(directory, ckpt_cfg)
    if not dist.is_initialized():  # DCP warns, from its background thread too, that one process saves alone: intended
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
    future = dcp.async_save(state_dict, process_group=checkpoint_process_group(), no_dist=not dist.is_initialized(),
                            **target)
    _in_flight[:] = [f for f in _in_flight if not f.done()] + [future]
    return PendingAsyncSave(future, iteration, finalize)


def abandon_in_flight_saves(timeout: float) -> int:
    """Wait up to ``timeout`` seconds for every background save of this process to end (a save whose peer died
    fails in its next collective), forget them, and return how many were still running at the deadline.

    Never finalized: the tracker keeps naming the newest complete checkpoint, and the ``.partial`` directory is
    replaced by the next save of that iteration."""
    deadline = time.monotonic() + timeout
    for future in _in_flight:
        while not future.done() and time.monotonic() < deadline:
            time.sleep(0.01)
    still_running = sum(1 for f in _in_flight if not f.done())
    _in_flight.clear()
    return still_running


def finalize_async_saves(checkpointing_context: dict[str, Any], blocking: bool = False) -> bool:
    """Complete a pending async save once every rank has finished writing; True when nothing is pending.

    Collective while a save is pending (every rank calls it at the same points of the loop). Trackers are
    written only here, after the shards of every rank are complete.
    """
    pending: PendingAsyncSave | None = checkpointing_context.get("pending_async_save")
    if pending is None:
        return True
    done = pending.future.done()
    if dist.is_initialized():  # on the training group, from the main thread: the background save is not on it
        flag = torch.tensor([1 if done else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        done = bool(flag.item())
    if not done and not blocking:
        return False
    pending.future.result()
    pending.finalize()
    checkpointing_context.pop("pending_async_save")
    return True
