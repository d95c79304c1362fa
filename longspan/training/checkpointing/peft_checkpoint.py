"""Adapter checkpoints as products: merged into a full checkpoint (``longspan peft merge``) and exported in
Hugging Face PEFT format (``longspan convert export --adapter-only``).

An adapter checkpoint holds only the adapters; its run_config.yaml names the base
(``checkpoint.pretrained_checkpoint``: a longspan checkpoint or an HF model directory), which
``load_model_from_checkpoint`` loads first.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import torch.distributed as dist

from longspan.conversion import AutoBridge
from longspan.core.errors import CheckpointError
from longspan.core.logging import get_logger, print_rank_0
from longspan.parallel.init import detect_launch
from longspan.peft.hf_export import save_hf_peft_adapter
from longspan.training.checkpointing.hf_weights import hf_pretrained_dir
from longspan.training.checkpointing.model_loading import load_checkpoint_config, load_model_from_checkpoint
from longspan.training.checkpointing.save import save_checkpoint
from longspan.training.state import GlobalState

logger = get_logger(__name__)


def _require_single_process(what: str) -> None:
    if detect_launch().world_size > 1 or (dist.is_initialized() and dist.get_world_size() > 1):
        raise CheckpointError(f"{what} runs on one process (the adapters are small): launch it without torchrun")


def merge_adapter_checkpoint(checkpoint: str | os.PathLike, output: str | os.PathLike,
                             overrides: Sequence[str] = ()) -> Path:
    """Write a full longspan checkpoint (iteration kept, weights only) with the adapters of ``checkpoint``
    folded into the base weights; its config has ``peft`` unset. Returns the save root ``output``."""
    _require_single_process("peft merge")
    if load_checkpoint_config(checkpoint, list(overrides)).cfg.peft is None:
        raise CheckpointError(f"checkpoint {checkpoint} holds no adapters (its config has no peft): nothing to merge")
    loaded = load_model_from_checkpoint(str(checkpoint), list(overrides), device="cpu", merge_adapters=True)
    cfg = loaded.cfg
    cfg.checkpoint.save = str(output)
    cfg.checkpoint.load = None
    cfg.checkpoint.save_optim = False
    cfg.checkpoint.save_rng = False
    state = GlobalState()
    state.cfg = cfg
    state.tokenizer = loaded.tokenizer
    state.train_state.step = loaded.iteration
    save_checkpoint(state, loaded.model, None, None, 0.0)
    print_rank_0(f"merged the adapters of {checkpoint} into {output} (iteration {loaded.iteration})", logger)
    return Path(output)


def export_adapter_checkpoint(checkpoint: str | os.PathLike, output: str | os.PathLike,
                              overrides: Sequence[str] = (), architecture: str | None = None) -> Path:
    """Write the adapters of ``checkpoint`` as an HF PEFT adapter directory (``adapter_config.json`` +
    ``adapter_model.safetensors``) for the HF form of its base model."""
    _require_single_process("convert export --adapter-only")
    if load_checkpoint_config(checkpoint, list(overrides)).cfg.peft is None:
        raise CheckpointError(
            f"checkpoint {checkpoint} holds no adapters (its config has no peft): export it without --adapter-only"
        )
    loaded = load_model_from_checkpoint(str(checkpoint), list(overrides), device="cpu")
    cfg = loaded.cfg
    bridge = AutoBridge.for_run(cfg, architecture)
    hf_dir = hf_pretrained_dir(cfg)
    save_hf_peft_adapter(loaded.model, cfg.peft, bridge, output,
                         base_model_name_or_path=str(hf_dir) if hf_dir is not None else None)
    print_rank_0(f"exported the adapters of {checkpoint} (iteration {loaded.iteration}) to {output}", logger)
    return Path(output)
