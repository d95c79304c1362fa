"""longspan's checkpoint format for ``AutoBridge.import_ckpt`` / ``export_ckpt`` (``longspan convert``).

``longspan.conversion`` derives the model from an HF directory and maps its weights, but sits below this layer
and does not know the checkpoint layout (tracker, ``iter_XXXXXXX``, DCP shards, run_config.yaml).
``TrainingCheckpointFormat`` is its ``CheckpointFormat``: a model-only checkpoint written by the
``save_checkpoint`` a run uses and read back by ``load_model_from_checkpoint``. ``from longspan import
AutoBridge`` plugs it into the conversion class.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

from torch import nn

from longspan.conversion import AutoBridge
from longspan.data.tokenizers import build_tokenizer
from longspan.parallel.init import detect_launch, initialize_distributed
from longspan.training.checkpointing.model_loading import (
    LoadedModel,
    load_checkpoint_config,
    load_model_from_checkpoint,
)
from longspan.training.checkpointing.save import get_checkpoint_dir, save_checkpoint
from longspan.training.state import GlobalState


class TrainingCheckpointFormat:
    """``longspan.conversion.checkpoints.CheckpointFormat`` with the training layer's save and load."""

    def save_model(self, cfg: Any, model: list[nn.Module], parallel: Any) -> Path:
        """The weights of ``model`` and ``cfg`` as the checkpoint of iteration 0 under ``cfg.checkpoint.save``
        (``cfg.checkpoint.save_optim`` / ``save_rng`` off: no optimizer or RNG state). Collective."""
        state = GlobalState()
        state.cfg = cfg
        state.parallel = parallel
        state.tokenizer = build_tokenizer(cfg.tokenizer)
        state.train_state.step = 0
        save_checkpoint(state, model, None, None, 0.0)
        return get_checkpoint_dir(cfg.checkpoint.save, 0)

    def load_model(self, path: str | os.PathLike, overrides: Sequence[str] = ()) -> LoadedModel:
        """The checkpoint's model: under a launch built for the saved layout (``overrides`` applied), on one
        process whole; an adapter checkpoint comes back with its adapters merged into the base weights."""
        parallel = None
        if detect_launch().world_size > 1:
            saved = load_checkpoint_config(path, list(overrides)).cfg
            parallel = initialize_distributed(saved.dist, saved.model)
        return load_model_from_checkpoint(str(path), list(overrides), parallel=parallel, merge_adapters=True)


def auto_bridge() -> type[AutoBridge]:
    """``AutoBridge`` with this format plugged in, so ``import_ckpt`` / ``export_ckpt`` read and write longspan
    checkpoints (what ``longspan.AutoBridge`` and ``longspan convert`` hand out)."""
    if AutoBridge.checkpoint_format is None:
        AutoBridge.checkpoint_format = TrainingCheckpointFormat()
    return AutoBridge


__all__ = ["TrainingCheckpointFormat", "auto_bridge"]
