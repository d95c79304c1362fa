"""Hugging Face model directories and longspan checkpoints: the ``convert`` commands.

The trainer-side helpers (HF directories as ``pretrained_checkpoint``, ``also_save_hf_checkpoint``) live in
``longspan.training.checkpointing.hf_weights``, below the checkpoint and setup modules that call them.

- ``import_hf_checkpoint`` / ``export_longspan_checkpoint``: ``longspan convert import|export`` and
  ``AutoBridge.import_ckpt`` / ``export_ckpt``.
- ``AutoBridge``: ``longspan.conversion.AutoBridge`` plus the two checkpoint methods (they need the training
  layer's checkpoint format); ``from longspan import AutoBridge`` is this one.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from longspan.conversion import bridge as bridge_mod
from longspan.conversion.bridge import ProgressLog, copy_tokenizer_files
from longspan.core.logging import get_logger, get_rank, print_rank_0
from longspan.training.checkpointing.hf_weights import HF_CONFIG_IN_CHECKPOINT, apply_hf_model_config, hf_pretrained_dir

logger = get_logger(__name__)


class AutoBridge(bridge_mod.AutoBridge):
    """``longspan.conversion.AutoBridge`` with ``import_ckpt`` / ``export_ckpt`` (longspan checkpoints)."""

    @classmethod
    def import_ckpt(cls, hf_path: str | os.PathLike, megatron_path: str | os.PathLike,
                    overrides: Sequence[str] = ()) -> Path:
        """Write the HF model at ``hf_path`` as a longspan checkpoint (iteration 0) under ``megatron_path``.

        ``overrides``: dotlist strings for the layout (``model.tensor_model_parallel_size=2``).
        """
        return import_hf_checkpoint(hf_path, megatron_path, overrides)

    def export_ckpt(self, megatron_path: str | os.PathLike, hf_path: str | os.PathLike) -> None:
        """Write the longspan checkpoint at ``megatron_path`` as the HF model directory ``hf_path``."""
        export_longspan_checkpoint(megatron_path, hf_path, architecture=self.family.architecture)


# ------------------------------------------------------------------------------------------ convert


# The recipe whose training settings an imported checkpoint's run_config.yaml carries, per provider class.
_IMPORT_RECIPES = {"T5ModelProvider": "tiny_t5"}


def import_hf_checkpoint(hf_path: str | os.PathLike, output: str | os.PathLike, overrides: Sequence[str] = (),
                         config_files: Sequence[str] = (), show_progress: bool = True) -> Path:
    """An HF model directory -> a longspan checkpoint at iteration 0 under ``output`` (a save root).

    The checkpoint holds the weights (no optimizer state), run_config.yaml (the ``tiny`` recipe's training
    settings and sequence length, ``tiny-t5``'s for T5, with the HF architecture, the HF tokenizer and the
    layout / ``model.seq_length`` from ``overrides``), the tokenizer files, the tracker, and the HF config.json it
    came from. Runs on every rank of a launch.
    """
    from longspan.recipes.loading import load_config
    from longspan.data.tokenizers import build_tokenizer
    from longspan.parallel import initialize_distributed
    from longspan.training.checkpointing.save import save_checkpoint
    from longspan.training.state import GlobalState

    bridge = AutoBridge.from_hf_pretrained(hf_path)
    recipe = _IMPORT_RECIPES.get(bridge.family.provider_class, "tiny")
    cfg = load_config(recipe, list(config_files), list(overrides))
    apply_hf_model_config(cfg, hf_path, keep_precision=False)
    cfg.tokenizer.vocab_extra_ids = 0  # the HF vocabulary is the model's (T5's holds its own sentinels)
    cfg.dataset.sequence_length = cfg.model.seq_length  # RoPE models: the recipe's (or model.seq_length=N)
    cfg.tokenizer.tokenizer_type = "HuggingFaceTokenizer"
    cfg.tokenizer.tokenizer_model = str(Path(hf_path).resolve())
    cfg.checkpoint.save = str(output)
    cfg.checkpoint.load = None
    cfg.checkpoint.pretrained_checkpoint = None
    cfg.checkpoint.save_optim = False
    cfg.checkpoint.save_rng = False
    has_tokenizer = (Path(hf_path) / "tokenizer.json").is_file() or (Path(hf_path) / "tokenizer_config.json").is_file()
    if not has_tokenizer:
        cfg.tokenizer.tokenizer_type = "NullTokenizer"
        cfg.tokenizer.tokenizer_model = None
        cfg.tokenizer.vocab_size = cfg.model.vocab_size
    parallel = initialize_distributed(cfg.dist, cfg.model, dp_replicate=cfg.ddp.num_distributed_optimizer_instances)
    provider = cfg.model
    model = bridge_mod.build_empty_model(cfg, parallel)
    total = sum(1 for chunk in model for _ in chunk.parameters())
    progress = ProgressLog(total, "import", enabled=show_progress and parallel.rank == 0)
    try:
        bridge.load_weights_into(model, progress=progress)
    finally:
        progress.close()
    state = GlobalState()
    state.cfg = cfg
    state.parallel = parallel
    state.tokenizer = build_tokenizer(cfg.tokenizer)
    state.train_state.step = 0
    save_checkpoint(state, model, None, None, 0.0)
    if parallel.rank == 0:
        from longspan.training.checkpointing.save import get_checkpoint_dir

        iter_dir = get_checkpoint_dir(output, 0)
        (iter_dir / HF_CONFIG_IN_CHECKPOINT).write_text((Path(hf_path) / "config.json").read_text())
        print_rank_0(f"imported {hf_path} ({bridge.family.architecture}, {provider.num_layers} layers) "
                     f"into {output} (iteration 0)", logger)
    return Path(output)


def export_longspan_checkpoint(checkpoint: str | os.PathLike, output: str | os.PathLike, overrides: Sequence[str] = (),
                               architecture: str | None = None, show_progress: bool = True) -> Path:
    """A longspan checkpoint (save root or iter_ directory) -> an HF model directory ``output``.

    The architecture is the HF config the checkpoint was imported from (``hf_config.json``), else the one
    matching the model (``architecture`` forces one). Runs on every rank of a launch.
    """
    import json

    from longspan.parallel.init import detect_launch, initialize_distributed
    from longspan.training.checkpointing.model_loading import load_checkpoint_config, load_model_from_checkpoint

    parallel = None
    if detect_launch().world_size > 1:  # the layout of the saved run, with the overrides applied
        saved = load_checkpoint_config(checkpoint, list(overrides)).cfg
        parallel = initialize_distributed(saved.dist, saved.model)
    # An adapter checkpoint exports merged (its base from pretrained_checkpoint, the adapters folded in).
    loaded = load_model_from_checkpoint(str(checkpoint), list(overrides), parallel=parallel, merge_adapters=True)
    cfg, model = loaded.cfg, loaded.model
    iter_dir = _iter_dir(checkpoint, loaded.iteration)
    source = iter_dir / HF_CONFIG_IN_CHECKPOINT if iter_dir is not None else None
    if source is not None and source.is_file() and architecture is None:
        bridge = AutoBridge.from_hf_config(json.loads(source.read_text()))
    else:
        hf_dir = hf_pretrained_dir(cfg)
        if hf_dir is not None and architecture is None:
            bridge = AutoBridge.from_hf_pretrained(hf_dir)
        else:
            bridge = AutoBridge.from_longspan_provider(cfg.model, architecture)
    total = sum(1 for chunk in model for _ in chunk.parameters())
    progress = ProgressLog(total, "export", enabled=show_progress and get_rank() == 0)
    try:
        bridge.save_hf_pretrained(model, output, progress=progress)
    finally:
        progress.close()
    if get_rank() == 0:
        copied = []
        if iter_dir is not None and (iter_dir / "tokenizer").is_dir():
            copied = copy_tokenizer_files(iter_dir / "tokenizer", output)
        tokenizer = getattr(loaded, "tokenizer", None)
        if not copied and type(tokenizer).__name__ == "HuggingFaceTokenizer":
            tokenizer.save_files(str(output))
        print_rank_0(f"exported {checkpoint} (iteration {loaded.iteration}) as {bridge.family.architecture} "
                     f"to {output}", logger)
    return Path(output)


def _iter_dir(checkpoint: str | os.PathLike, iteration: int) -> Path | None:
    from longspan.training.checkpointing.save import get_checkpoint_dir, read_tracker

    path = Path(checkpoint)
    if (path / ".metadata").is_file():
        return path
    if read_tracker(path) is not None:
        return get_checkpoint_dir(path, iteration)
    return None


__all__ = ["AutoBridge", "import_hf_checkpoint", "export_longspan_checkpoint"]
