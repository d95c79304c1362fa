"""``checkpoint.ckpt_convert_format`` / ``ckpt_convert_save``: Megatron's checkpoint conversion run.

The run loads ``checkpoint.load`` as usual (any layout, any world size: DCP reshards on load), writes what it
loaded to ``{ckpt_convert_save}/{ckpt_convert_format}`` at the loaded iteration, and stops without training.
longspan writes ``torch_dist`` only, so that is the one target format; the conversion rewrites a checkpoint
for this run's model and settings (its tensor names, ``storage_writers_per_rank``, optimizer state or not).
"""

from __future__ import annotations

import os
from typing import Any

from longspan.core.logging import get_logger, print_rank_0
from longspan.training.checkpointing.async_save import finalize_async_saves
from longspan.training.checkpointing.save import save_checkpoint

logger = get_logger(__name__)


def converted_checkpoint_root(ckpt_cfg: Any) -> str:
    """Where the converted checkpoint goes: ``{ckpt_convert_save}/{ckpt_convert_format}`` (as Megatron)."""
    return os.path.join(ckpt_cfg.ckpt_convert_save, ckpt_cfg.ckpt_convert_format)


def convert_loaded_checkpoint(state: Any, model: list, optimizer: Any, scheduler: Any,
                              checkpointing_context: dict[str, Any]) -> None:
    """Save the state ``setup`` loaded in the conversion's format and directory (collective)."""
    ckpt_cfg = state.cfg.checkpoint
    root = converted_checkpoint_root(ckpt_cfg)
    save_checkpoint(state, model, optimizer, scheduler, state.train_state.floating_point_operations_so_far,
                    checkpointing_context, save_dir=root)
    finalize_async_saves(checkpointing_context, blocking=True)
    print_rank_0(f"converted checkpoint: {ckpt_cfg.ckpt_format} -> {ckpt_cfg.ckpt_convert_format} "
                 f"(iteration {state.train_state.step}) in {root}; exiting without training", logger)
