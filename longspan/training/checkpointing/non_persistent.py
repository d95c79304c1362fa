"""Non-persistent checkpoints (``checkpoint.non_persistent_*``): frequent, cheap saves that are overwritten.

- ``global``: an ordinary ``torch_dist`` checkpoint written to ``non_persistent_global_ckpt_dir`` (default
  ``{save}/non_persistent``); after each new one is complete, the older ``iter_*`` directories there are removed.
- ``local``: each rank ``torch.save``s its own state (its local shards of model and optimizer, scheduler, RNG,
  train state including the data position, rerun-machine state) to
  ``{non_persistent_local_ckpt_dir}/rank{R}_of{W}/iter_XXXXXXX.pt``, written to a temporary name and renamed
  (atomic). Once every rank has its new file, older ones are removed, so a crash mid-save always leaves one
  iteration that every rank holds. With ``checkpoint.replication`` each file is also copied to clique peers
(``replication.py``), so a rank whose node lost its files gets them back on resume.

At start-up ``load_newest_checkpoint`` compares the persistent checkpoint (``checkpoint.load``), the newest
complete global non-persistent one and the newest iteration every rank holds locally, and loads the newest.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from longspan.core.errors import CheckpointError
from longspan.core.logging import get_logger, print_rank_0
from longspan.training.checkpointing import replication
from longspan.training.checkpointing.load import LoadedCheckpoint, find_checkpoint, load_checkpoint
from longspan.training.checkpointing.save import get_checkpoint_dir, get_rng_state, read_tracker, save_checkpoint

logger = get_logger(__name__)

_LOCAL_FILE = re.compile(r"^iter_(\d{7})\.pt$")
_ITER_DIR = re.compile(r"^iter_(\d{7})$")
_SHARD_MARK = "__local_shard__"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def global_ckpt_dir(ckpt_cfg: Any) -> Optional[str]:
    """Where global non-persistent checkpoints go: the configured directory, else ``{save}/non_persistent``."""
    if ckpt_cfg.non_persistent_global_ckpt_dir:
        return ckpt_cfg.non_persistent_global_ckpt_dir
    return os.path.join(ckpt_cfg.save, "non_persistent") if ckpt_cfg.save else None


def local_rank_dir(ckpt_cfg: Any, rank: int | None = None, world_size: int | None = None) -> Path:
    """This rank's directory of local non-persistent checkpoints."""
    rank = _rank() if rank is None else rank
    world_size = _world_size() if world_size is None else world_size
    return Path(ckpt_cfg.non_persistent_local_ckpt_dir) / f"rank{rank}_of{world_size}"


def should_save_non_persistent(ckpt_cfg: Any, step: int) -> bool:
    """Whether iteration ``step`` ends with a non-persistent save (a persistent one takes precedence)."""
    interval = ckpt_cfg.non_persistent_save_interval
    return bool(ckpt_cfg.non_persistent_ckpt_type and interval and step % interval == 0)


# ------------------------------------------------------------------------------------------------ save


def save_non_persistent(
    state: Any,
    model: list[torch.nn.Module],
    optimizer: Any,
    scheduler: Any,
    num_floating_point_operations_so_far: float,
    checkpointing_context: dict[str, Any],
    train_data_iterator: Any = None,
) -> None:
    """Save a non-persistent checkpoint of the kind ``checkpoint.non_persistent_ckpt_type`` names."""
    ckpt_cfg = state.cfg.checkpoint
    kind = ckpt_cfg.non_persistent_ckpt_type
    if kind == "global":
        root = global_ckpt_dir(ckpt_cfg)
        save_checkpoint(
            state, model, optimizer, scheduler, num_floating_point_operations_so_far, checkpointing_context,
            train_data_iterator=train_data_iterator, save_dir=root,
        )
        if _rank() == 0:
            _remove_older_global(Path(root))
    elif kind == "local":
        state.train_state.floating_point_operations_so_far = num_floating_point_operations_so_far
        save_local(state, model, optimizer, scheduler)
    else:
        raise CheckpointError(f"checkpoint.non_persistent_ckpt_type={kind!r} cannot be saved; use global or local")


def _remove_older_global(root: Path) -> None:
    """Remove the ``iter_*`` directories older than the one the tracker names (an async save's
    directory is removed at the next save, once its tracker moved on)."""
    latest = read_tracker(root)
    if latest is None:
        return
    for entry in root.iterdir():
        match = _ITER_DIR.match(entry.name)
        if match and int(match.group(1)) < latest:
            shutil.rmtree(entry, ignore_errors=True)


def _to_local(obj: Any) -> Any:
    """State with every DTensor replaced by its local shard (plain tensors on the CPU, picklable)."""
    if hasattr(obj, "to_local") and hasattr(obj, "placements"):
        return {_SHARD_MARK: obj.to_local().detach().cpu().clone()}
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: _to_local(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_local(v) for v in obj)
    return obj


def _from_local(saved: Any, like: Any) -> Any:
    """Rebuild a value saved by ``_to_local`` on the device (and DTensor layout) of ``like``."""
    if isinstance(saved, dict) and _SHARD_MARK in saved:
        if not isinstance(like, DTensor):
            raise CheckpointError("a local non-persistent checkpoint holds a sharded tensor where the model has none; "
                                  "the parallel layout changed since it was saved")
        local = saved[_SHARD_MARK].to(device=like.to_local().device, dtype=like.dtype)
        return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False,
                                  shape=like.shape, stride=like.stride())
    if isinstance(saved, torch.Tensor) and isinstance(like, torch.Tensor):
        return saved.to(device=like.device)
    return saved


def _torch_optimizer(optimizer: Any) -> Optional[torch.optim.Optimizer]:
    if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    return getattr(optimizer, "optimizer", None)


def _local_state(state: Any, model: list[torch.nn.Module], optimizer: Any, scheduler: Any) -> dict[str, Any]:
    ckpt_cfg = state.cfg.checkpoint
    out: dict[str, Any] = {
        "iteration": int(state.train_state.step),
        "rank": _rank(),
        "world_size": _world_size(),
        "model": [_to_local(chunk.state_dict()) for chunk in model],
        "train_state": state.train_state.state_dict(),
    }
    torch_opt = _torch_optimizer(optimizer)
    if ckpt_cfg.save_optim and torch_opt is not None:
        out["optimizer"] = _to_local(torch_opt.state_dict())
        if getattr(optimizer, "float16_groups", None) and any(optimizer.float16_groups):
            out["main_params"] = [_to_local(optimizer.main_params_module(chunk).state_dict()) for chunk in model]
        scaler = getattr(optimizer, "grad_scaler", None)
        if scaler is not None:
            out["grad_scaler"] = scaler.state_dict()
    if scheduler is not None:
        out["scheduler"] = scheduler.state_dict()
    if ckpt_cfg.save_rng:
        out["rng"] = get_rng_state()
    machine = getattr(state, "rerun_state_machine", None)
    if machine is not None and hasattr(machine, "state_dict"):
        out["rerun_state_machine"] = machine.state_dict()
    return out


def save_local(state: Any, model: list[torch.nn.Module], optimizer: Any, scheduler: Any) -> Path:
    """Write this rank's local checkpoint atomically; once every rank has, remove the older ones."""
    ckpt_cfg = state.cfg.checkpoint
    directory = local_rank_dir(ckpt_cfg)
    directory.mkdir(parents=True, exist_ok=True)
    iteration = int(state.train_state.step)
    path = directory / f"iter_{iteration:07d}.pt"
    tmp = directory / f".iter_{iteration:07d}.pt.tmp{os.getpid()}"
    torch.save(_local_state(state, model, optimizer, scheduler), tmp)
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    if ckpt_cfg.replication:
        replication.replicate(ckpt_cfg, path)
    if dist.is_initialized():
        dist.barrier()  # every rank holds `iteration` (and its replicas) before anyone drops an older one
    for entry in directory.iterdir():
        match = _LOCAL_FILE.match(entry.name)
        if (match and int(match.group(1)) != iteration) or entry.name.startswith(".iter_"):
            entry.unlink(missing_ok=True)
    replication.remove_older_replicas(directory, path.name)
    print_rank_0(f"  saved local non-persistent checkpoint of iteration {iteration:7d} to {directory.parent}", logger)
    return path


# ------------------------------------------------------------------------------------------------ load


def local_iterations(ckpt_cfg: Any) -> list[int]:
    """The iterations of this rank's complete local checkpoints, newest first."""
    directory = local_rank_dir(ckpt_cfg)
    if not directory.is_dir():
        return []
    found = [int(m.group(1)) for m in (_LOCAL_FILE.match(p.name) for p in directory.iterdir()) if m]
    return sorted(found, reverse=True)


def newest_common_local_iteration(ckpt_cfg: Any) -> Optional[int]:
    """The newest iteration every rank holds a complete local checkpoint of (collective), or None."""
    mine = set(local_iterations(ckpt_cfg))
    if dist.is_initialized():
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, sorted(mine))
        common = set(gathered[0]).intersection(*map(set, gathered[1:]))
    else:
        common = mine
    return max(common) if common else None


def newest_global_checkpoint(ckpt_cfg: Any) -> Optional[tuple[Path, int]]:
    """(directory, iteration) of the newest complete global non-persistent checkpoint, or None."""
    root = global_ckpt_dir(ckpt_cfg)
    if not root:
        return None
    iteration = read_tracker(root)
    if iteration is None:
        return None
    directory = get_checkpoint_dir(root, iteration)
    return (directory, iteration) if (directory / ".metadata").is_file() else None


def load_local(state: Any, model: list[torch.nn.Module], optimizer: Any, scheduler: Any, iteration: int) -> LoadedCheckpoint:
    """Load this rank's local checkpoint of ``iteration``; the RNG state is returned, not applied."""
    ckpt_cfg = state.cfg.checkpoint
    path = local_rank_dir(ckpt_cfg) / f"iter_{iteration:07d}.pt"
    try:
        saved = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # a damaged file is the user's to remove
        raise CheckpointError(f"cannot read local non-persistent checkpoint {path}: {exc}") from None
    if len(saved["model"]) != len(model):
        raise CheckpointError(f"{path} holds {len(saved['model'])} model chunks; this run has {len(model)}")
    for chunk, chunk_sd in zip(model, saved["model"]):
        current = chunk.state_dict()
        chunk.load_state_dict({k: _from_local(v, current.get(k)) for k, v in chunk_sd.items()})
    torch_opt = _torch_optimizer(optimizer)
    if ckpt_cfg.load_optim and torch_opt is not None and "optimizer" in saved:
        _load_optimizer(torch_opt, saved["optimizer"])
        if "main_params" in saved:
            _load_main_params(optimizer, model, saved["main_params"])
        scaler = getattr(optimizer, "grad_scaler", None)
        if scaler is not None and "grad_scaler" in saved:
            scaler.load_state_dict(saved["grad_scaler"])
    elif getattr(optimizer, "float16_groups", None) and any(optimizer.float16_groups):
        if ckpt_cfg.load_main_params_from_ckpt and "main_params" in saved:
            _load_main_params(optimizer, model, saved["main_params"])
        else:
            optimizer.reload_model_params()  # no optimizer state loaded: the fp32 main copies follow the weights
    if scheduler is not None and "scheduler" in saved:
        scheduler.load_state_dict(saved["scheduler"])
    machine = getattr(state, "rerun_state_machine", None)
    if machine is not None and "rerun_state_machine" in saved:
        machine.load_state_dict(saved["rerun_state_machine"])
    state.train_state.load_state_dict(saved["train_state"])
    print_rank_0(f"loaded local non-persistent checkpoint of iteration {iteration} from {path.parent.parent}", logger)
    return LoadedCheckpoint(path, iteration, saved.get("rng") if ckpt_cfg.load_rng else None)


def _load_main_params(optimizer: Any, model: list[torch.nn.Module], saved: list[dict[str, Any]]) -> None:
    """The saved fp32 main params into the optimizer's main copies, then rounded into the model."""
    for chunk, main_sd in zip(model, saved):
        main = optimizer.main_params_module(chunk)
        current = main.state_dict()
        main.load_state_dict({k: _from_local(v, current.get(k)) for k, v in main_sd.items()})
    optimizer.copy_main_params_to_model_params()


def _load_optimizer(torch_opt: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """Optimizer state whose sharded entries are rebuilt on their parameter's DTensor layout."""
    params = [p for group in torch_opt.param_groups for p in group["params"]]
    state = {}
    for index, entries in saved["state"].items():
        param = params[int(index)]
        state[index] = {
            k: _from_local(v, param) if isinstance(v, dict) else (v.to(param.device) if isinstance(v, torch.Tensor) and v.dim() else v)
            for k, v in entries.items()
        }
    torch_opt.load_state_dict({"state": state, "param_groups": saved["param_groups"]})


def load_newest_checkpoint(
    state: Any,
    model: list[torch.nn.Module],
    optimizer: Any,
    scheduler: Any,
    checkpointing_context: dict[str, Any] | None = None,
) -> Optional[LoadedCheckpoint]:
    """Resume from the newest checkpoint of any kind: persistent, global non-persistent, or local.

    Without non-persistent checkpoints configured this is ``load_checkpoint``. Ties go to the persistent one.
    """
    ckpt_cfg = state.cfg.checkpoint
    kind = ckpt_cfg.non_persistent_ckpt_type
    if kind is None or ckpt_cfg.finetune or ckpt_cfg.ckpt_step is not None:
        return load_checkpoint(state, model, optimizer, scheduler, checkpointing_context=checkpointing_context)
    persistent = find_checkpoint(ckpt_cfg) if ckpt_cfg.load or ckpt_cfg.pretrained_checkpoint else None
    if persistent is not None and persistent[2]:  # finetuning from pretrained weights: no resume
        persistent_iter = -1
    else:
        persistent_iter = persistent[1] if persistent is not None else -1
    if kind == "local" and ckpt_cfg.replication:
        local_iter, inventories = replication.newest_recoverable_iteration(
            ckpt_cfg, local_iterations(ckpt_cfg), local_rank_dir(ckpt_cfg))
        if local_iter is not None and local_iter > persistent_iter:
            replication.restore_missing(ckpt_cfg, local_iter, inventories, local_rank_dir(ckpt_cfg))
            return load_local(state, model, optimizer, scheduler, local_iter)
    elif kind == "local":
        local_iter = newest_common_local_iteration(ckpt_cfg)
        if local_iter is not None and local_iter > persistent_iter:
            return load_local(state, model, optimizer, scheduler, local_iter)
    elif kind == "global":
        found = newest_global_checkpoint(ckpt_cfg)
        if found is not None and found[1] > persistent_iter:
            print_rank_0(f"resuming from the non-persistent checkpoint {found[0]} (newer than checkpoint.load)", logger)
            np_cfg = dataclasses.replace(ckpt_cfg, load=str(found[0].parent), pretrained_checkpoint=None)
            return load_checkpoint(state, model, optimizer, scheduler,
                                   checkpointing_context=checkpointing_context, checkpoint_config=np_cfg)
    return load_checkpoint(state, model, optimizer, scheduler, checkpointing_context=checkpointing_context)
