"""Hugging Face model directories in training runs and longspan checkpoints.

- ``apply_hf_pretrained_config(cfg)``: with ``checkpoint.pretrained_checkpoint`` an HF directory, the model
  architecture comes from its config.json (layout and precision fields of the recipe stay) and the tokenizer
  from its tokenizer files.
- ``load_hf_pretrained(directory, model)``: the HF weights into the built chunks (instead of a DCP load).
- ``save_hf_checkpoint(state, model, directory)``: ``checkpoint.also_save_hf_checkpoint``.
- ``import_hf_checkpoint`` / ``export_longspan_checkpoint``: ``longspan convert import|export`` and
  ``AutoBridge.import_ckpt`` / ``export_ckpt``.
- ``AutoBridge``: ``longspan.conversion.AutoBridge`` plus the two checkpoint methods (they need the training
  layer's checkpoint format); ``from longspan import AutoBridge`` is this one.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from longspan.conversion import bridge as bridge_mod
from longspan.conversion.bridge import ProgressLog, copy_tokenizer_files, is_hf_model_dir
from longspan.core.errors import CheckpointError, ConfigError
from longspan.core.logging import get_logger, print_rank_0

logger = get_logger(__name__)

#: the HF config.json a converted checkpoint was imported from (kept for the export)
HF_CONFIG_IN_CHECKPOINT = "hf_config.json"
#: the HF directory ``also_save_hf_checkpoint`` writes inside each iter_XXXXXXX directory
HF_SUBDIR = "hf"

# Fields of the recipe that an HF config.json does not override: the layout and precision (the
# ModelParallelConfig fields) and, for RoPE models, the training sequence length.
_KEEP_FROM_RECIPE_ROPE = ("seq_length",)
# T5's relative positions have no length limit either: the recipe's encoder and decoder lengths stay.
_KEEP_FROM_RECIPE_RELATIVE = ("seq_length", "seq_length_dec", "max_position_embeddings")


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


# ------------------------------------------------------------------------------------------ training runs


def hf_pretrained_dir(cfg: Any) -> Path | None:
    """``checkpoint.pretrained_checkpoint`` when it is an HF model directory, else None."""
    ckpt = getattr(cfg, "checkpoint", None)
    path = getattr(ckpt, "pretrained_checkpoint", None) if ckpt is not None else None
    return Path(path) if path and is_hf_model_dir(path) else None


def apply_hf_model_config(cfg: Any, hf_dir: str | os.PathLike, keep_precision: bool = True) -> list[str]:
    """Set ``cfg.model``'s architecture from the HF config.json in ``hf_dir``; returns the changed fields.

    The layout fields (ModelParallelConfig's) stay, and with ``keep_precision`` so does the dtype; RoPE
    models keep the recipe's ``seq_length`` (learned position tables take the HF one).
    """
    from longspan.core.model_parallel_config import ModelParallelConfig

    hf_provider = AutoBridge.from_hf_pretrained(hf_dir).to_megatron_provider(load_weights=False)
    keep = {f.name for f in dataclasses.fields(ModelParallelConfig)}
    if not keep_precision:
        keep -= {"params_dtype"}
    if hf_provider.position_embedding_type == "rope":
        keep |= set(_KEEP_FROM_RECIPE_ROPE)
    if hf_provider.position_embedding_type == "relative":
        keep |= set(_KEEP_FROM_RECIPE_RELATIVE)
    if type(cfg.model) is not type(hf_provider):
        raise ConfigError(
            f"checkpoint.pretrained_checkpoint={str(hf_dir)!r} holds a {type(hf_provider).__name__} model but the "
            f"recipe's model is a {type(cfg.model).__name__}: use a recipe of the same family (e.g. tiny-t5 for T5)"
        )
    changed = []
    for f in dataclasses.fields(hf_provider):
        if f.name in keep:
            continue
        value = getattr(hf_provider, f.name)
        if getattr(cfg.model, f.name) != value:
            setattr(cfg.model, f.name, value)
            changed.append(f.name)
    return changed


def apply_hf_pretrained_config(cfg: Any) -> bool:
    """With an HF directory as ``checkpoint.pretrained_checkpoint``: architecture and tokenizer from it.

    Returns whether it applied. The tokenizer becomes ``HuggingFaceTokenizer`` on the directory when it holds
    tokenizer files.
    """
    hf_dir = hf_pretrained_dir(cfg)
    if hf_dir is None:
        return False
    changed = apply_hf_model_config(cfg, hf_dir)
    if any((hf_dir / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        cfg.tokenizer.tokenizer_type = "HuggingFaceTokenizer"
        cfg.tokenizer.tokenizer_model = str(hf_dir)
    print_rank_0(f"pretrained_checkpoint {hf_dir} is a Hugging Face model: model fields from its config.json"
                 f" ({', '.join(sorted(changed)) or 'none changed'})", logger)
    return True


def load_hf_pretrained(directory: str | os.PathLike, model: list[torch.nn.Module],
                       select: Callable[[str], bool] | None = None) -> int:
    """Load the HF weights of ``directory`` into the built chunks (any layout); returns the tensor count."""
    bridge = AutoBridge.from_hf_pretrained(directory)
    count = bridge.load_weights_into(model, select=select)
    print_rank_0(f"loaded Hugging Face weights from {directory} ({count} tensors) for finetuning; "
                 "starting at iteration 0", logger)
    return count


def bridge_for_run(cfg: Any) -> AutoBridge:
    """The bridge that exports a run's model: its HF source when it started from one, else the matching one."""
    hf_dir = hf_pretrained_dir(cfg)
    if hf_dir is not None:
        return AutoBridge.from_hf_pretrained(hf_dir)
    return AutoBridge.from_longspan_provider(cfg.model)


def save_hf_checkpoint(state: Any, model: list[torch.nn.Module], directory: str | os.PathLike) -> None:
    """``checkpoint.also_save_hf_checkpoint``: the model as an HF directory (collective; rank 0 writes)."""
    bridge = bridge_for_run(state.cfg)
    bridge.save_hf_pretrained(model, directory)
    tokenizer = getattr(state, "tokenizer", None)
    if _rank() == 0 and bridge.hf_path is None and type(tokenizer).__name__ == "HuggingFaceTokenizer":
        tokenizer.save_files(str(directory))


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


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
    from longspan.config import load_config
    from longspan.data.tokenizers import build_tokenizer
    from longspan.parallel import initialize_distributed
    from longspan.training.checkpointing import save_checkpoint
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
        from longspan.training.checkpointing import get_checkpoint_dir

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
    from longspan.training.model_loading import load_checkpoint_config, load_model_from_checkpoint

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
    progress = ProgressLog(total, "export", enabled=show_progress and _rank() == 0)
    try:
        bridge.save_hf_pretrained(model, output, progress=progress)
    finally:
        progress.close()
    if _rank() == 0:
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
    from longspan.training.checkpointing import get_checkpoint_dir, read_tracker

    path = Path(checkpoint)
    if (path / ".metadata").is_file():
        return path
    if read_tracker(path) is not None:
        return get_checkpoint_dir(path, iteration)
    return None


__all__ = ["AutoBridge", "apply_hf_pretrained_config", "load_hf_pretrained", "save_hf_checkpoint",
           "import_hf_checkpoint", "export_longspan_checkpoint", "hf_pretrained_dir", "CheckpointError"]
