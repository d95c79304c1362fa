"""Build a model from a saved longspan checkpoint: for generation, export and evaluation scripts.

``load_model_from_checkpoint(path)`` reads the checkpoint's ``run_config.yaml`` (the architecture, tokenizer and
precision it was trained with), applies dotlist overrides, rebuilds the tokenizer from the files saved beside
the weights (``iter_XXXXXXX/tokenizer/``), builds the model and loads only its weights (``model.*`` keys) with
Distributed Checkpoint. Optimizer, scheduler and RNG state stay on disk.

On one process (``parallel=None``) the model is built whole on the meta device and materialized without
drawing random weights; the checkpoint reshards from whatever layout trained it. Under a process group, pass
the ``ParallelState`` from ``initialize_distributed`` (built from ``load_checkpoint_config(path).cfg``): the
model is built for that layout the way training builds it, then the weights are loaded into the shards.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from longspan.config.explicit import mark_model_family
from longspan.config.overrides import apply_overrides
from longspan.config.schema.container import ConfigContainer
from longspan.conversion import is_hf_model_dir
from longspan.conversion.checkpoints import read_model_family
from longspan.core.errors import CheckpointError, ConfigError
from longspan.core.logging import get_logger, print_rank_0
from longspan.data.tokenizers import Tokenizer, build_tokenizer, model_vocab_size
from longspan.models.builder import build_meta_model
from longspan.parallel.pipeline import state_dict_module
from longspan.peft.adapters import is_adapter_key, is_finetuned_state_key, merge_adapters as merge_adapter_weights
from longspan.peft.qlora import quantize_base_weights
from longspan.training.checkpointing.hf_weights import load_hf_pretrained
from longspan.training.checkpointing.io import check_shapes, iteration_from_dir, load_shards, single_process_quiet
from longspan.training.checkpointing.load import use_saved_tokenizer
from longspan.training.checkpointing.save import (
    RUN_CONFIG_FILENAME,
    TOKENIZER_DIRNAME,
    TRACKER_FILENAME,
    get_checkpoint_dir,
    read_tracker,
)
from longspan.training.setup import build_model

logger = get_logger(__name__)

# ModelParallelConfig fields that describe a layout: a one-process load resets them to one rank.
_ONE_PROCESS_LAYOUT = {
    "tensor_model_parallel_size": 1,
    "pipeline_model_parallel_size": 1,
    "virtual_pipeline_model_parallel_size": None,
    "context_parallel_size": 1,
    "expert_model_parallel_size": 1,
    "expert_tensor_parallel_size": None,
    "sequence_parallel": False,
}
_LAYOUT_OVERRIDE_KEYS = {f"model.{name}" for name in _ONE_PROCESS_LAYOUT}


@dataclass
class SavedCheckpoint:
    """Where a checkpoint is and the configuration it was saved with (overrides applied)."""

    directory: Path
    """The ``iter_XXXXXXX`` directory holding the weights."""
    iteration: int
    """The training iteration the checkpoint was saved at."""
    cfg: ConfigContainer
    """The ConfigContainer of ``run_config.yaml``, overrides applied, tokenizer pointed at the saved files."""


@dataclass
class LoadedModel:
    """A model rebuilt from a checkpoint, ready for inference."""

    cfg: ConfigContainer
    """The ConfigContainer the model was built from (saved run_config.yaml plus overrides)."""
    model: list[nn.Module]
    """The model chunks (one unless pipeline parallel), weights loaded, in eval mode."""
    tokenizer: Tokenizer
    """The tokenizer saved with the checkpoint."""
    iteration: int
    """The training iteration of the checkpoint."""
    directory: Path
    """The ``iter_XXXXXXX`` directory the weights came from."""


def resolve_checkpoint_dir(path: str | os.PathLike) -> tuple[Path, int]:
    """``(iter_XXXXXXX directory, iteration)`` for a save root (with the tracker file) or an iteration directory."""
    root = Path(path)
    if not root.exists():
        raise CheckpointError(f"checkpoint {root} does not exist: give a checkpoint.save directory or an iter_ directory")
    if not root.is_dir():
        raise CheckpointError(f"checkpoint {root} is a file: give a checkpoint.save directory or an iter_ directory")
    iteration = read_tracker(root)
    if iteration is not None:
        directory = get_checkpoint_dir(root, iteration)
    elif (root / ".metadata").is_file() or (root / RUN_CONFIG_FILENAME).is_file():
        directory = root
        iteration = iteration_from_dir(directory) if (root / ".metadata").is_file() else 0
    else:
        raise CheckpointError(
            f"{root} holds no longspan checkpoint (no {TRACKER_FILENAME}, no iter_ directory's .metadata)"
        )
    if not (directory / ".metadata").is_file():
        raise CheckpointError(f"checkpoint {directory} is missing or incomplete (no .metadata file)")
    if not (directory / RUN_CONFIG_FILENAME).is_file():
        raise CheckpointError(f"checkpoint {directory} has no {RUN_CONFIG_FILENAME}: cannot tell which model it holds")
    return directory, iteration


def load_checkpoint_config(path: str | os.PathLike, overrides: Sequence[str] = ()) -> SavedCheckpoint:
    """Find the checkpoint at ``path`` and read its run_config.yaml, with dotlist ``overrides`` applied.

    Unless an override names a ``tokenizer.`` field, the tokenizer is the one saved with the checkpoint. The
    model family the checkpoint records (``model_family.json``) is marked on the config
    (``config.explicit.model_family``).
    """
    directory, iteration = resolve_checkpoint_dir(path)
    cfg = ConfigContainer.from_yaml(str(directory / RUN_CONFIG_FILENAME))
    family = read_model_family(directory)
    if family is not None:  # the family the checkpoint records: a re-save keeps it, the export reads it
        mark_model_family(cfg, family)
    saved_tokenizer = directory / TOKENIZER_DIRNAME
    if saved_tokenizer.is_dir() and not any(o.strip().startswith("tokenizer.") for o in overrides):
        use_saved_tokenizer(cfg.tokenizer, saved_tokenizer)
    apply_overrides(cfg, overrides)
    return SavedCheckpoint(directory, iteration, cfg)


def load_model_weights(directory: Path, model: list[nn.Module], select: Callable[[str], bool] | None = None) -> None:
    """Load the ``model.*`` tensors of the checkpoint in ``directory`` into ``model`` (any layout); ``select``
    limits the tensors to those names (PEFT: base and adapters come from two checkpoints)."""
    module = state_dict_module(model)
    model_sd = get_model_state_dict(module)
    if select is not None:
        model_sd = {k: v for k, v in model_sd.items() if select(k)}
    check_shapes(directory, model_sd, "model")
    to_load = {"model": model_sd}
    with single_process_quiet():
        load_shards(to_load, directory, no_dist=not dist.is_initialized())
    set_model_state_dict(module, to_load["model"], options=StateDictOptions(strict=select is None))


def _load_adapter_checkpoint(cfg: Any, directory: Path, model: list[nn.Module]) -> None:
    """PEFT: the base from the ``pretrained_checkpoint`` saved in the config, then what the finetune changed
    (adapters, routing bias) from ``directory``."""
    base = cfg.checkpoint.pretrained_checkpoint
    if not base:
        raise CheckpointError(
            f"checkpoint {directory} holds adapters (peft is set) but its config names no "
            "checkpoint.pretrained_checkpoint to take the base model from; pass checkpoint.pretrained_checkpoint=DIR"
        )

    if is_hf_model_dir(base):
        load_hf_pretrained(base, model, select=lambda k: not is_adapter_key(k))
    else:
        base_dir, _ = resolve_checkpoint_dir(base)
        load_model_weights(base_dir, model, select=lambda k: not is_adapter_key(k))
    load_model_weights(directory, model, select=is_finetuned_state_key)


def _default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _build_one_process(cfg: Any, device: torch.device) -> list[nn.Module]:
    """The whole model on ``device``, memory allocated but not drawn (the checkpoint fills it)."""
    for name, value in _ONE_PROCESS_LAYOUT.items():
        if hasattr(cfg.model, name):
            setattr(cfg.model, name, value)
    model = build_meta_model(cfg.model)
    if cfg.peft is not None:  # adapters on the meta model, like training; both checkpoints fill them
        cfg.peft.apply(model)
    model.to_empty(device=device)
    return [model]


def load_model_from_checkpoint(
    path: str | os.PathLike,
    overrides: Sequence[str] = (),
    *,
    parallel: Any = None,
    device: str | torch.device | None = None,
    merge_adapters: bool = False,
) -> LoadedModel:
    """Rebuild the model, tokenizer and config of the longspan checkpoint at ``path``.

    Args:
        path: a save root (``checkpoint.save``, with ``latest_checkpointed_iteration.txt``) or an
            ``iter_XXXXXXX`` directory.
        overrides: dotlist overrides applied to the saved run_config.yaml (``model.params_dtype=bf16`` ...).
        parallel: the ``ParallelState`` of an initialized process group to build the model for its layout;
            None builds the whole model on this one process (the layout fields of the saved config are reset
            to one rank; the checkpoint reshards).
        device: one-process only: where the model lives; default CUDA when available, else the CPU.
        merge_adapters: for an adapter checkpoint (``peft`` set in its config), fold the adapters into the base
            weights (one process): the model is then a plain model and ``cfg.peft`` is None.

    An adapter checkpoint loads its base from the ``checkpoint.pretrained_checkpoint`` saved in its config (a
    longspan checkpoint or an HF model directory), then its adapters.

    Raises ``CheckpointError`` (one line) for a missing, incomplete or mismatching checkpoint.
    """
    found = load_checkpoint_config(path, overrides)
    cfg = found.cfg
    tokenizer = build_tokenizer(cfg.tokenizer)
    if cfg.model.vocab_size is None:
        cfg.model.vocab_size = model_vocab_size(tokenizer, cfg.tokenizer)
    if hasattr(cfg.model, "finalize"):
        cfg.model.finalize()
    if parallel is None:
        layout_overrides = [o for o in overrides if o.split("=", 1)[0].strip() in _LAYOUT_OVERRIDE_KEYS]
        if layout_overrides:
            raise ConfigError(
                f"override {layout_overrides[0]!r} asks for a parallel layout, but parallel=None loads the model on "
                "one process: drop the override, or pass parallel=<ParallelState> built for that layout"
            )
        if dist.is_initialized() and dist.get_world_size() > 1:
            raise CheckpointError(
                f"load_model_from_checkpoint({path}) runs under {dist.get_world_size()} processes: pass "
                "parallel=<ParallelState> to build the model for the layout, or run one process"
            )
        model = _build_one_process(cfg, torch.device(device) if device is not None else _default_device())
    elif merge_adapters and cfg.peft is not None:
        raise CheckpointError("merge_adapters=True needs the whole model on one process: pass parallel=None")
    else:
        if device is not None:
            raise CheckpointError("device= is for one-process loads; with parallel= the device is the layout's")
        model = build_model(cfg, parallel, cfg.rng.seed, pre_wrap_hook=cfg.peft.apply if cfg.peft is not None else None)
    if cfg.peft is not None:
        _load_adapter_checkpoint(cfg, found.directory, model)
        quantize_base_weights(model, cfg.peft)  # QLoRA: the adapters were trained on the NF4 base; merge onto it
        if merge_adapters:
            model = [merge_adapter_weights(chunk) for chunk in model]
            cfg.peft = None
    else:
        load_model_weights(found.directory, model)
    for chunk in model:
        chunk.eval()
    print_rank_0(f"loaded model weights from {found.directory} (iteration {found.iteration})", logger)
    return LoadedModel(cfg=cfg, model=model, tokenizer=tokenizer, iteration=found.iteration, directory=found.directory)


__all__ = [
    "SavedCheckpoint",
    "LoadedModel",
    "load_checkpoint_config",
    "load_model_from_checkpoint",
    "load_model_weights",
    "resolve_checkpoint_dir",
]
