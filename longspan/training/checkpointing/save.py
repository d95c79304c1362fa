"""Checkpoints in the ``torch_dist`` format: PyTorch Distributed Checkpoint (DCP) plus Megatron's layout.

```
{save}/latest_checkpointed_iteration.txt   the step, written last, after every shard is complete
{save}/latest_train_state.pt
{save}/iter_0000100/                       .metadata, __{rank}_{k}.distcp, train_state.pt,
                                           run_config.yaml, metadata.json, tokenizer/
```

A save goes to ``iter_XXXXXXX.partial`` and is renamed into place only once complete, and the tracker is
replaced atomically after that: a crash or Ctrl-C mid-save leaves the previous checkpoint loadable.
Model and optimizer state go through ``torch.distributed.checkpoint.state_dict`` so DTensor-sharded
(tensor parallel / FSDP2) state is saved by global name and shape and reshards on load under another
layout. Per-rank state (RNG) is saved under rank-unique keys: DCP keeps one copy of identical keys.
This module writes checkpoints and defines their layout; ``load.py`` reads them back.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)

from longspan.config.explicit import model_family
from longspan.conversion.checkpoints import write_model_family
from longspan.config.schema.container import ConfigContainer
from longspan.config.schema.training import CheckpointConfig
from longspan.core.errors import CheckpointError
from longspan.core.logging import get_logger, print_rank_0
from longspan.parallel.pipeline import state_dict_module
from longspan.peft.adapters import is_finetuned_state_key
from longspan.training.callbacks import fire_event
from longspan.training.checkpointing.async_save import dcp_save_arguments, finalize_async_saves, start_async_save
from longspan.training.checkpointing.hf_weights import HF_SUBDIR, save_hf_checkpoint
from longspan.training.checkpointing.io import TRAIN_STATE_FILENAME, single_process_quiet

logger = get_logger(__name__)

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
LATEST_TRAIN_STATE_FILENAME = "latest_train_state.pt"
RUN_CONFIG_FILENAME = "run_config.yaml"
METADATA_FILENAME = "metadata.json"
TOKENIZER_DIRNAME = "tokenizer"
CHECKPOINT_VERSION = 1


def checkpoint_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def get_checkpoint_dir(root: str | os.PathLike, iteration: int) -> Path:
    return Path(root) / checkpoint_dir_name(iteration)


def read_tracker(root: str | os.PathLike) -> int | None:
    """The iteration named by ``latest_checkpointed_iteration.txt``, or None when there is none."""
    tracker = Path(root) / TRACKER_FILENAME
    if not tracker.is_file():
        return None
    text = tracker.read_text().strip()
    if text == "release":
        return 0
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(f"{tracker} holds {text!r}; expected an iteration number") from None


def current_rank() -> int:
    """This process's rank in the default group (0 without torch.distributed)."""
    return dist.get_rank() if dist.is_initialized() else 0


def current_world_size() -> int:
    """The default group's size (1 without torch.distributed)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _atomic_torch_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    torch.save(obj, tmp)
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------------- RNG state


def get_rng_state() -> dict[str, Any]:
    """This rank's python, numpy, torch and CUDA generator states."""
    state = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda_rng_state"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if "cuda_rng_state" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda_rng_state"])


def rng_key_for(rank: int, world_size: int) -> str:
    # The world size is part of the key: a resume under another layout has no matching RNG state and
    # starts its generators from the seed instead (as Megatron does).
    return f"rank{rank}_of{world_size}"


# ----------------------------------------------------------------------------------------- state dicts


def unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer behind a Megatron-style optimizer wrapper."""
    if optimizer is None:
        return None
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        return inner
    raise TypeError(f"cannot find the torch optimizer inside {type(optimizer).__name__}")


def optimizer_extra_state(optimizer: Any) -> dict[str, Any]:
    """Wrapper state beyond the torch optimizer: the fp16 loss scaler."""
    scaler = getattr(optimizer, "grad_scaler", None)
    return {"grad_scaler": scaler.state_dict()} if scaler is not None else {}


def optimizer_module(module: torch.nn.Module, optimizer: Any) -> torch.nn.Module:
    """The module whose parameters the torch optimizer updates: fp32 main copies of low-precision params."""
    if getattr(optimizer, "float16_groups", None) and any(optimizer.float16_groups):
        return optimizer.main_params_module(module)
    return module


def checkpoint_module(model: list[torch.nn.Module]) -> torch.nn.Module:
    """The module to save/load: the chunk itself, or (pipeline stages) one module holding every chunk's
    parameters under the unpipelined names, so checkpoints move between pipeline layouts."""
    return state_dict_module(model)


# Optimizer state keyed by parameter name (``state.<name>.*``, ``param_groups.<name>.*``): each pipeline rank
# saves and loads only its own parameters' entries, so any layout reads any other's checkpoint.
OPTIM_SD_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def _build_state_dict(
    model: list[torch.nn.Module],
    optimizer: Any,
    scheduler: Any,
    *,
    with_optimizer: bool,
    with_rng: bool,
    rng_state: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
    model_keys: Callable[[str], bool] | None = None,
) -> dict[str, Any]:
    module = checkpoint_module(model)
    state: dict[str, Any] = {"model": get_model_state_dict(module)}
    if model_keys is not None:  # PEFT: what the finetune changes (the base comes from pretrained_checkpoint)
        state["model"] = {k: v for k, v in state["model"].items() if model_keys(k)}
    if with_optimizer and optimizer is not None:
        main_module = optimizer_module(module, optimizer)
        state["optimizer"] = get_optimizer_state_dict(
            main_module, unwrap_optimizer(optimizer), options=OPTIM_SD_OPTIONS
        )
        if main_module is not module:
            state["main_params"] = main_module.state_dict()
        state["optimizer_extra"] = optimizer_extra_state(optimizer)
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    if with_rng:
        rng = rng_state if rng_state is not None else get_rng_state()
        state["rng"] = {rng_key_for(current_rank(), current_world_size()): rng}
    if extra:
        state.update(extra)
    return state


# -------------------------------------------------------------------------------------------------- save


def check_save_dir_writable(save: str) -> None:
    """Fail at start-up (not after hours of training) when ``checkpoint.save`` cannot be written.

    Nothing is created: the directory (or, when it does not exist yet, its nearest existing parent) must be a
    writable directory, so a run stopped later by a bad input leaves no trace in the save directory.
    """
    path = Path(save).absolute()
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise CheckpointError(f"checkpoint.save={save}: {existing} is not a directory; choose a writable directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise CheckpointError(
            f"checkpoint.save={save} is not writable ({existing} denies writing); choose a writable directory"
        )


def _check_finite_weights(model: list[torch.nn.Module]) -> None:
    for chunk in model:
        for name, param in chunk.named_parameters():
            local = param.to_local() if hasattr(param, "to_local") else param
            if not torch.isfinite(local).all():
                raise CheckpointError(
                    f"refusing to checkpoint: parameter {name} holds NaN or Inf values; the run has diverged"
                )


def save_checkpoint(
    state: Any,
    model: list[torch.nn.Module],
    optimizer: Any,
    opt_param_scheduler: Any,
    num_floating_point_operations_so_far: float,
    checkpointing_context: dict[str, Any] | None = None,
    non_persistent_ckpt: bool = False,
    train_data_iterator: Any = None,
    *,
    save_dir: str | os.PathLike | None = None,
) -> None:
    """Save model, optimizer, scheduler, RNG and train state for ``state.train_state.step``.

    The data position is ``train_state.consumed_train_samples`` / ``consumed_valid_samples``: Megatron's
    samplers restart from them, so a resumed run reads exactly the samples it would have read.
    ``save_dir`` replaces ``checkpoint.save`` (global non-persistent checkpoints).
    """
    if non_persistent_ckpt:
        raise NotImplementedError(
            "non-persistent saves go through longspan.training.checkpointing.non_persistent.save_non_persistent"
        )
    cfg = state.cfg
    ckpt_cfg = cfg.checkpoint
    context = checkpointing_context if checkpointing_context is not None else {}
    finalize_async_saves(context, blocking=True)

    iteration = state.train_state.step
    state.train_state.floating_point_operations_so_far = num_floating_point_operations_so_far
    root = Path(save_dir if save_dir is not None else ckpt_cfg.save)
    final_dir = get_checkpoint_dir(root, iteration)
    partial_dir = final_dir.with_name(final_dir.name + ".partial")

    _check_finite_weights(model)
    if current_rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        if partial_dir.exists():
            shutil.rmtree(partial_dir)  # left by a crash mid-save; the tracker never pointed at it
        partial_dir.mkdir(parents=True)
    _barrier()

    if ckpt_cfg.also_save_hf_checkpoint:  # collective; renamed into place with the rest
        save_hf_checkpoint(state, model, partial_dir / HF_SUBDIR)
    state_dict = _build_state_dict(
        model,
        optimizer,
        opt_param_scheduler,
        with_optimizer=ckpt_cfg.save_optim,
        with_rng=ckpt_cfg.save_rng,
        extra=rerun_state(state),
        model_keys=_peft_model_keys(cfg),
    )
    train_state_dict = state.train_state.state_dict()

    def finalize() -> None:
        _barrier()
        if current_rank() == 0:
            _write_side_files(state, partial_dir, train_state_dict)
            old_dir = final_dir.with_name(final_dir.name + ".old")
            if final_dir.exists():
                os.replace(final_dir, old_dir)
            os.replace(partial_dir, final_dir)
            if old_dir.exists():
                shutil.rmtree(old_dir)
            _atomic_torch_save(train_state_dict, root / LATEST_TRAIN_STATE_FILENAME)
            _atomic_write_text(root / TRACKER_FILENAME, str(iteration))
            if save_dir is None:  # most_recent_k is about checkpoint.save; non-persistent ones have their own cleanup
                protected = protected_load_iterations(ckpt_cfg, root)
                remove_old_checkpoints(root, ckpt_cfg.most_recent_k, protected)
        _barrier()
        print_rank_0(f"  successfully saved checkpoint from iteration {iteration:7d} to {root}", logger)
        fire_event(state, "on_checkpoint_save", model, optimizer=optimizer, scheduler=opt_param_scheduler)

    print_rank_0(f"saving checkpoint at iteration {iteration:7d} to {root} in torch_dist format", logger)
    if ckpt_cfg.async_save:  # on a group of its own (async_checkpoint): training goes on meanwhile
        context["pending_async_save"] = start_async_save(state_dict, partial_dir, iteration, finalize, ckpt_cfg)
    else:
        with single_process_quiet():
            dcp.save(state_dict, no_dist=not dist.is_initialized(), **dcp_save_arguments(partial_dir, ckpt_cfg))
        finalize()


def complete_checkpoint_iterations(root: Path) -> list[int]:
    """Iterations of the complete checkpoints under ``root`` (renamed into place: no ``.partial``), oldest first."""
    iterations = []
    for entry in root.glob("iter_*"):
        digits = entry.name[len("iter_"):]
        if entry.is_dir() and digits.isdigit():
            iterations.append(int(digits))
    return sorted(iterations)


def protected_load_iterations(ckpt_cfg: CheckpointConfig, root: Path) -> set[int]:
    """Iterations under ``root`` that ``checkpoint.load`` points at (its ``ckpt_step``, or an ``iter_`` directory
    named directly): never removed by ``most_recent_k``, so a run can always be started again from them."""
    load = ckpt_cfg.load
    if not load:
        return set()
    load_path = Path(load).resolve()
    if load_path == root.resolve():
        step = ckpt_cfg.ckpt_step
        return {int(step)} if step is not None else set()
    if load_path.parent == root.resolve() and load_path.name[len("iter_"):].isdigit():
        return {int(load_path.name[len("iter_"):])}
    return set()


def remove_old_checkpoints(root: Path, most_recent_k: int | None, protected: set[int]) -> None:
    """Keep the ``most_recent_k`` newest complete checkpoints under ``root`` (-1 or None: keep all).

    Runs after the tracker names the newest save, so the newest complete checkpoint is always among those kept;
    ``protected`` iterations (what ``checkpoint.load`` points at) are kept too. ``.partial`` directories are
    never touched here: the next save of that iteration replaces them.
    """
    if most_recent_k is None or most_recent_k < 0:
        return
    newest = read_tracker(root)
    iterations = complete_checkpoint_iterations(root)
    keep = set(iterations[-most_recent_k:]) | protected | ({newest} if newest is not None else set())
    for iteration in iterations:
        if iteration not in keep:
            shutil.rmtree(get_checkpoint_dir(root, iteration), ignore_errors=True)
            logger.info("removed checkpoint %s (checkpoint.most_recent_k=%d)", checkpoint_dir_name(iteration),
                        most_recent_k)


def rerun_state(state: Any) -> dict[str, Any]:
    """The rerun state machine's checkpoint section (empty when the run has none)."""
    machine = getattr(state, "rerun_state_machine", None)
    if machine is None or not hasattr(machine, "state_dict"):
        return {}
    return {"rerun_state_machine": machine.state_dict()}


def _write_side_files(state: Any, directory: Path, train_state_dict: dict[str, Any]) -> None:
    torch.save(train_state_dict, directory / TRAIN_STATE_FILENAME)
    state.cfg.to_yaml(str(directory / RUN_CONFIG_FILENAME))
    family = model_family(state.cfg)
    if family is not None:  # which HF family the model is built as: the export reads it (model_family.json)
        write_model_family(directory, family)
    metadata = {
        "format": "torch_dist",
        "longspan_checkpoint_version": CHECKPOINT_VERSION,
        "iteration": int(train_state_dict["step"]),
        "world_size": current_world_size(),
        "torch_version": torch.__version__,
    }
    (directory / METADATA_FILENAME).write_text(json.dumps(metadata, indent=2) + "\n")
    tokenizer = getattr(state, "tokenizer", None)
    save_assets = state.cfg.checkpoint.save_tokenizer_assets
    if save_assets and tokenizer is not None and hasattr(tokenizer, "save_files"):
        tokenizer.save_files(str(directory / TOKENIZER_DIRNAME))


def _peft_model_keys(cfg: ConfigContainer) -> Callable[[str], bool] | None:
    """With PEFT, the model tensors a checkpoint holds: the adapters and the buffers the finetune updates
    (``longspan.peft.adapters.is_finetuned_state_key``)."""
    if cfg.peft is None:
        return None
    return is_finetuned_state_key
