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
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import dataclass
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
    set_model_state_dict,
    set_optimizer_state_dict,
)

from longspan.core.errors import CheckpointError
from longspan.training.async_checkpoint import finalize_async_saves, start_async_save
from longspan.training.checkpoint_io import (
    TRAIN_STATE_FILENAME,
    check_shapes,
    iteration_from_dir,
    load_shards,
    load_weights_only,
    read_metadata,
    reading,
    single_process_quiet,
)
from longspan.core.logging import get_logger, print_rank_0

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


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
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


def _rng_key(rank: int, world_size: int) -> str:
    # The world size is part of the key: a resume under another layout has no matching RNG state and
    # starts its generators from the seed instead (as Megatron does).
    return f"rank{rank}_of{world_size}"


# ----------------------------------------------------------------------------------------- state dicts


def _unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer behind a Megatron-style optimizer wrapper."""
    if optimizer is None:
        return None
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        return inner
    raise TypeError(f"cannot find the torch optimizer inside {type(optimizer).__name__}")


def _optimizer_extra_state(optimizer: Any) -> dict[str, Any]:
    """Wrapper state beyond the torch optimizer: the fp16 loss scaler."""
    scaler = getattr(optimizer, "grad_scaler", None)
    return {"grad_scaler": scaler.state_dict()} if scaler is not None else {}


def _load_optimizer_extra_state(optimizer: Any, extra: dict[str, Any]) -> None:
    scaler = getattr(optimizer, "grad_scaler", None)
    if scaler is not None and "grad_scaler" in extra:
        scaler.load_state_dict(extra["grad_scaler"])


def _optimizer_module(module: torch.nn.Module, optimizer: Any) -> torch.nn.Module:
    """The module whose parameters the torch optimizer updates: fp32 main copies of low-precision params."""
    if getattr(optimizer, "float16_groups", None) and any(optimizer.float16_groups):
        return optimizer.main_params_module(module)
    return module


def _model_module(model: list[torch.nn.Module]) -> torch.nn.Module:
    """The module to save/load: the chunk itself, or (pipeline stages) one module holding every chunk's
    parameters under the unpipelined names, so checkpoints move between pipeline layouts."""
    from longspan.parallel.pipeline import state_dict_module

    return state_dict_module(model)


# Optimizer state keyed by parameter name (``state.<name>.*``, ``param_groups.<name>.*``): each pipeline rank
# saves and loads only its own parameters' entries, so any layout reads any other's checkpoint.
_OPTIM_SD_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


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
    module = _model_module(model)
    state: dict[str, Any] = {"model": get_model_state_dict(module)}
    if model_keys is not None:  # PEFT: only the adapters (the base comes from pretrained_checkpoint)
        state["model"] = {k: v for k, v in state["model"].items() if model_keys(k)}
    if with_optimizer and optimizer is not None:
        main_module = _optimizer_module(module, optimizer)
        state["optimizer"] = get_optimizer_state_dict(
            main_module, _unwrap_optimizer(optimizer), options=_OPTIM_SD_OPTIONS
        )
        if main_module is not module:
            state["main_params"] = main_module.state_dict()
        state["optimizer_extra"] = _optimizer_extra_state(optimizer)
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    if with_rng:
        state["rng"] = {_rng_key(_rank(), _world_size()): rng_state if rng_state is not None else get_rng_state()}
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
            "non-persistent saves go through longspan.training.resilience.non_persistent.save_non_persistent"
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
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        if partial_dir.exists():
            shutil.rmtree(partial_dir)  # left by a crash mid-save; the tracker never pointed at it
        partial_dir.mkdir(parents=True)
    _barrier()

    if getattr(ckpt_cfg, "also_save_hf_checkpoint", False):  # collective; renamed into place with the rest
        from longspan.training.hf_weights import HF_SUBDIR, save_hf_checkpoint

        save_hf_checkpoint(state, model, partial_dir / HF_SUBDIR)
    state_dict = _build_state_dict(
        model,
        optimizer,
        opt_param_scheduler,
        with_optimizer=ckpt_cfg.save_optim,
        with_rng=ckpt_cfg.save_rng,
        extra=_rerun_state(state),
        model_keys=_adapter_keys(cfg),
    )
    train_state_dict = state.train_state.state_dict()

    def finalize() -> None:
        _barrier()
        if _rank() == 0:
            _write_side_files(state, partial_dir, train_state_dict)
            old_dir = final_dir.with_name(final_dir.name + ".old")
            if final_dir.exists():
                os.replace(final_dir, old_dir)
            os.replace(partial_dir, final_dir)
            if old_dir.exists():
                shutil.rmtree(old_dir)
            _atomic_torch_save(train_state_dict, root / LATEST_TRAIN_STATE_FILENAME)
            _atomic_write_text(root / TRACKER_FILENAME, str(iteration))
        _barrier()
        print_rank_0(f"  successfully saved checkpoint from iteration {iteration:7d} to {root}", logger)

    print_rank_0(f"saving checkpoint at iteration {iteration:7d} to {root} in torch_dist format", logger)
    if ckpt_cfg.async_save:  # on a group of its own (async_checkpoint): training goes on meanwhile
        context["pending_async_save"] = start_async_save(state_dict, partial_dir, iteration, finalize)
    else:
        with single_process_quiet():
            dcp.save(state_dict, checkpoint_id=str(partial_dir), no_dist=not dist.is_initialized())
        finalize()


def _rerun_state(state: Any) -> dict[str, Any]:
    machine = getattr(state, "rerun_state_machine", None)
    if machine is None or not hasattr(machine, "state_dict"):
        return {}
    return {"rerun_state_machine": machine.state_dict()}


def _write_side_files(state: Any, directory: Path, train_state_dict: dict[str, Any]) -> None:
    torch.save(train_state_dict, directory / TRAIN_STATE_FILENAME)
    state.cfg.to_yaml(str(directory / RUN_CONFIG_FILENAME))
    metadata = {
        "format": "torch_dist",
        "longspan_checkpoint_version": CHECKPOINT_VERSION,
        "iteration": int(train_state_dict["step"]),
        "world_size": _world_size(),
        "torch_version": torch.__version__,
    }
    (directory / METADATA_FILENAME).write_text(json.dumps(metadata, indent=2) + "\n")
    tokenizer = getattr(state, "tokenizer", None)
    if tokenizer is not None and hasattr(tokenizer, "save_files"):
        tokenizer.save_files(str(directory / TOKENIZER_DIRNAME))


# -------------------------------------------------------------------------------------------------- load


@dataclass
class LoadedCheckpoint:
    """What ``load_checkpoint`` found: the directory, its iteration, and RNG state still to be applied."""

    directory: Path
    iteration: int
    rng_state: dict[str, Any] | None = None


def find_checkpoint(ckpt_cfg: Any) -> tuple[Path, int, bool] | None:
    """(directory, iteration, is_finetune) of the checkpoint to load, or None to start from scratch.

    ``checkpoint.load`` wins when it holds a checkpoint; otherwise ``pretrained_checkpoint`` loads weights
    only (finetuning). ``ckpt_step`` picks an iteration other than the tracker's.
    """
    for root, pretrained in ((ckpt_cfg.load, False), (ckpt_cfg.pretrained_checkpoint, True)):
        if not root:
            continue
        root_path = Path(root)
        if pretrained and _is_hf_model_dir(root_path):
            return root_path, 0, True  # Hugging Face weights: load_checkpoint reads them through AutoBridge
        if ckpt_cfg.ckpt_step is not None and not pretrained:
            iteration = ckpt_cfg.ckpt_step
        else:
            iteration = read_tracker(root_path)
        if iteration is None:
            if (root_path / ".metadata").is_file():  # pointed straight at an iter_ directory
                return root_path, iteration_from_dir(root_path), pretrained or ckpt_cfg.finetune
            if ckpt_cfg.exit_on_missing_checkpoint or pretrained:
                field_name = "checkpoint.pretrained_checkpoint" if pretrained else "checkpoint.load"
                raise CheckpointError(
                    f"{field_name}={root}: no checkpoint there ({TRACKER_FILENAME} not found)"
                    + ("" if pretrained else "; unset checkpoint.exit_on_missing_checkpoint to start from scratch")
                )
            continue
        directory = get_checkpoint_dir(root_path, iteration)
        if not (directory / ".metadata").is_file():
            raise CheckpointError(f"checkpoint {directory} is missing or incomplete (no .metadata file)")
        return directory, iteration, pretrained or ckpt_cfg.finetune
    return None


def _is_hf_model_dir(path: Path) -> bool:
    from longspan.conversion import is_hf_model_dir

    return is_hf_model_dir(path)


def _stored_keys(directory: Path) -> set[str]:
    return set(read_metadata(directory).state_dict_metadata)


def load_checkpoint(
    state: Any,
    model: list[torch.nn.Module],
    optimizer: Any,
    opt_param_scheduler: Any,
    strict: bool = True,
    checkpointing_context: dict[str, Any] | None = None,
    skip_load_to_model_and_opt: bool = False,
    *,
    checkpoint_config: Any = None,
    model_keys: Callable[[str], bool] | None = None,
) -> LoadedCheckpoint | None:
    """Load the checkpoint ``checkpoint.load`` (or ``pretrained_checkpoint``) names into model and state.

    Restores model, optimizer (``load_optim``), scheduler and train state; returns the RNG state (when
    ``load_rng``) without applying it, because RNG must be restored after everything that draws from it at
    start-up (building data iterators does). Returns None when there is nothing to load.
    ``checkpoint_config`` replaces ``cfg.checkpoint``; ``model_keys`` limits the model tensors loaded (PEFT).
    """
    cfg = state.cfg
    ckpt_cfg = checkpoint_config if checkpoint_config is not None else cfg.checkpoint
    found = find_checkpoint(ckpt_cfg)
    if found is None:
        return None
    directory, iteration, finetune = found
    if _is_hf_model_dir(directory):
        from longspan.training.hf_weights import load_hf_pretrained

        load_hf_pretrained(directory, model, select=model_keys)
        return LoadedCheckpoint(directory, 0, None)
    module = _model_module(model)
    stored = _stored_keys(directory)

    model_sd = get_model_state_dict(module)
    if model_keys is not None:
        model_sd = {k: v for k, v in model_sd.items() if model_keys(k)}
        strict = False  # the other tensors come from another checkpoint
    check_shapes(directory, model_sd, "model")
    load_optim = ckpt_cfg.load_optim and not finetune and optimizer is not None
    load_rng = ckpt_cfg.load_rng and not finetune
    if load_optim and not any(k.startswith("optimizer.") for k in stored):
        raise CheckpointError(
            f"checkpoint {directory} holds no optimizer state (saved with save_optim=false); "
            "set checkpoint.load_optim=false to load the weights only"
        )

    to_load: dict[str, Any] = {"model": model_sd}
    torch_optimizer = _unwrap_optimizer(optimizer) if load_optim else None
    main_module = _optimizer_module(module, optimizer) if load_optim else module
    if load_optim:
        to_load.update(_optimizer_sections(optimizer, torch_optimizer, module, main_module, stored))
    if not finetune and opt_param_scheduler is not None and any(k.startswith("scheduler") for k in stored):
        to_load["scheduler"] = opt_param_scheduler.state_dict()
    rng_key = _rng_key(_rank(), _world_size())
    has_rng = load_rng and any(k.startswith(f"rng.{rng_key}") for k in stored)
    if has_rng:
        to_load["rng"] = {rng_key: get_rng_state()}
    elif load_rng:
        print_rank_0(
            "checkpoint holds no RNG state for this world size; generators start from the seed instead", logger
        )
    if not finetune and "rerun_state_machine" in {k.split(".")[0] for k in stored}:
        rerun = _rerun_state(state)
        if rerun:
            to_load.update(rerun)

    if not skip_load_to_model_and_opt:
        with single_process_quiet():
            load_shards(to_load, directory, no_dist=not dist.is_initialized())
        set_model_state_dict(module, to_load["model"], options=StateDictOptions(strict=strict))
        if load_optim:
            _restore_optimizer(to_load, optimizer, torch_optimizer, module, main_module)
    if "scheduler" in to_load:
        _restore_scheduler(opt_param_scheduler, to_load["scheduler"], iteration, directory, ckpt_cfg)
    if "rerun_state_machine" in to_load:
        state.rerun_state_machine.load_state_dict(to_load["rerun_state_machine"])

    if finetune:
        print_rank_0(f"loaded weights from {directory} for finetuning; starting at iteration 0", logger)
        iteration = 0
    else:
        _restore_train_state(state, directory)
        print_rank_0(f"loaded checkpoint {directory} at iteration {iteration}", logger)
    return LoadedCheckpoint(directory, iteration, to_load["rng"][rng_key] if has_rng else None)


def _optimizer_sections(optimizer: Any, torch_optimizer: torch.optim.Optimizer | None, module: torch.nn.Module,
                        main_module: torch.nn.Module, stored: set[str]) -> dict[str, Any]:
    """The optimizer's templates for ``dcp.load``: its state, the main params and extra state the checkpoint has."""
    sections: dict[str, Any] = {
        "optimizer": get_optimizer_state_dict(main_module, torch_optimizer, options=_OPTIM_SD_OPTIONS)}
    if main_module is not module and any(k.startswith("main_params.") for k in stored):
        sections["main_params"] = main_module.state_dict()
    if any(k.startswith("optimizer_extra") for k in stored):
        sections["optimizer_extra"] = _optimizer_extra_state(optimizer)
    return sections


def _restore_optimizer(to_load: dict[str, Any], optimizer: Any, torch_optimizer: torch.optim.Optimizer | None,
                       module: torch.nn.Module, main_module: torch.nn.Module) -> None:
    """Put the loaded optimizer sections back; main params (when saved) are copied to the model params."""
    set_optimizer_state_dict(
        main_module, torch_optimizer, to_load["optimizer"], options=_OPTIM_SD_OPTIONS
    )
    _load_optimizer_extra_state(optimizer, to_load.get("optimizer_extra", {}))
    if main_module is not module:
        if "main_params" in to_load:
            main_module.load_state_dict(to_load["main_params"])
            optimizer.copy_main_params_to_model_params()
        else:
            optimizer.reload_model_params()


def _restore_scheduler(opt_param_scheduler: Any, scheduler_state: dict[str, Any], iteration: int, directory: Path,
                       ckpt_cfg: Any) -> None:
    try:
        opt_param_scheduler.load_state_dict(scheduler_state)
    except CheckpointError as exc:
        # Say the real situation first: this run resumes an earlier run's checkpoint.
        raise CheckpointError(
            f"resuming the checkpoint at iteration {iteration} in {directory} (checkpoint.load="
            f"{ckpt_cfg.load}), whose learning-rate schedule differs from this config: {exc}; to start fresh "
            "instead, set checkpoint.load=null or use another checkpoint.save directory"
        ) from exc


def _restore_train_state(state: Any, directory: Path) -> None:
    train_state_file = directory / TRAIN_STATE_FILENAME
    train_state_dict = load_weights_only(train_state_file, "training progress")
    with reading(train_state_file, "training progress"):
        if not isinstance(train_state_dict, dict) or "step" not in train_state_dict:
            raise ValueError(f"it holds {type(train_state_dict).__name__} without a 'step' entry")
        state.train_state.load_state_dict(train_state_dict)


def _adapter_keys(cfg: Any) -> Callable[[str], bool] | None:
    """With PEFT, the model tensors a checkpoint holds: the adapters' (``longspan.peft``)."""
    if getattr(cfg, "peft", None) is None:
        return None
    from longspan.peft.adapters import is_adapter_key

    return is_adapter_key


def load_peft_checkpoint(
    state: Any,
    model: list[torch.nn.Module],
    optimizer: Any,
    opt_param_scheduler: Any,
    checkpointing_context: dict[str, Any] | None = None,
) -> LoadedCheckpoint | None:
    """PEFT: the frozen base from ``pretrained_checkpoint`` (weights only), then, when ``checkpoint.load`` holds
    a checkpoint of this run, its adapters, optimizer, scheduler, RNG and progress. Starting fresh, DoRA's
    magnitudes are set from the loaded base."""
    import dataclasses as _dc

    from longspan.peft.adapters import init_dora_magnitudes, is_adapter_key

    ckpt_cfg = state.cfg.checkpoint
    if not ckpt_cfg.pretrained_checkpoint:
        raise CheckpointError(
            "peft is set but checkpoint.pretrained_checkpoint is not: adapters train on a pretrained base; set it "
            "to a longspan checkpoint (or Hugging Face model directory)"
        )
    base_cfg = _dc.replace(ckpt_cfg, load=None)
    load_checkpoint(state, model, None, None, checkpointing_context=checkpointing_context,
                    checkpoint_config=base_cfg, model_keys=lambda k: not is_adapter_key(k))
    resume_cfg = _dc.replace(ckpt_cfg, pretrained_checkpoint=None)
    if resume_cfg.load and find_checkpoint(resume_cfg) is not None:
        return load_checkpoint(state, model, optimizer, opt_param_scheduler,
                               checkpointing_context=checkpointing_context, checkpoint_config=resume_cfg,
                               model_keys=is_adapter_key)
    init_dora_magnitudes(model)
    return None


def use_saved_tokenizer(tokenizer_cfg: Any, saved: Path) -> None:
    """Point ``tokenizer_cfg`` at the tokenizer files saved in a checkpoint (``Tokenizer.save_files``)."""
    ttype = tokenizer_cfg.tokenizer_type
    if ttype == "HuggingFaceTokenizer":
        tokenizer_cfg.tokenizer_model = str(saved)
    elif ttype == "SentencePieceTokenizer" and (saved / "tokenizer.model").is_file():
        tokenizer_cfg.tokenizer_model = str(saved / "tokenizer.model")
    elif ttype == "GPT2BPETokenizer" and (saved / "vocab.json").is_file():
        tokenizer_cfg.vocab_file = str(saved / "vocab.json")
        tokenizer_cfg.merge_file = str(saved / "merges.txt")
    # NullTokenizer and ByteLevelTokenizer are described by the config alone.


def _adopt_saved_tokenizer(cfg: Any, saved_cfg: Any, directory: Path) -> None:
    """A run that names no tokenizer (the finetuning recipes) takes the checkpoint's, from its saved files."""
    if cfg.tokenizer.tokenizer_type is not None:
        return
    cfg.tokenizer = saved_cfg.tokenizer
    saved_files = directory / TOKENIZER_DIRNAME
    if saved_files.is_dir():
        use_saved_tokenizer(cfg.tokenizer, saved_files)
    print_rank_0(f"use_checkpoint_args: tokenizer {cfg.tokenizer.tokenizer_type} from {directory}", logger)


def apply_checkpoint_args(cfg: Any) -> list[str]:
    """``checkpoint.use_checkpoint_args``: take the model architecture from the checkpoint's run_config.yaml.

    Every model field except the parallel layout (ModelParallelConfig's fields) is copied, so a run resumes
    with the saved architecture whatever the recipe says. Returns the names of the fields that changed.
    """
    from longspan.core.model_parallel_config import copy_model_fields

    found = find_checkpoint(cfg.checkpoint)
    if found is None or _is_hf_model_dir(found[0]):  # an HF directory's config.json is applied at setup
        return []
    run_config = found[0] / RUN_CONFIG_FILENAME
    if not run_config.is_file():
        raise CheckpointError(f"checkpoint.use_checkpoint_args=true but {run_config} does not exist")
    saved_cfg = type(cfg).from_yaml(str(run_config))
    _adopt_saved_tokenizer(cfg, saved_cfg, found[0])
    saved = saved_cfg.model
    if type(saved) is not type(cfg.model):
        raise CheckpointError(
            f"checkpoint {found[0]} holds a {type(saved).__name__}, but this run builds a {type(cfg.model).__name__}"
        )
    changed = copy_model_fields(saved, cfg.model)
    if changed:
        print_rank_0(f"use_checkpoint_args: model fields from {run_config}: {', '.join(sorted(changed))}", logger)
    return changed
