"""What conversion needs to write and read longspan checkpoints (``AutoBridge.import_ckpt`` / ``export_ckpt``).

Conversion knows what a model is: the provider derived from an HF config.json and the weights mapped tensor by
tensor. The checkpoint format (tracker file, ``iter_XXXXXXX`` directories, DCP shards, run_config.yaml) belongs
to the training layer, which sits above this package. The two meet at ``CheckpointFormat``: two operations the
training layer implements (``longspan.training.checkpointing.hf_checkpoint.TrainingCheckpointFormat``) with the
same save and load code a run uses. ``longspan.AutoBridge`` is ``longspan.conversion.AutoBridge`` with it plugged
in, so this package never imports training and there is one copy of the format.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Protocol, Sequence

from torch import nn

from longspan.config.overrides import apply_overrides
from longspan.config.schema.container import ConfigContainer
from longspan.config.schema.data import TokenizerConfig
from longspan.config.schema.training import CheckpointConfig, TrainingConfig
from longspan.conversion.families import family_named
from longspan.core.errors import CheckpointError
from longspan.core.progress import Progress

#: the HF config.json a converted checkpoint was imported from (inside its iter_ directory; the export reads it)
HF_CONFIG_IN_CHECKPOINT = "hf_config.json"
#: the model family a checkpoint was built as (inside its iter_ directory): {"family": Family.name,
#: "architecture": its HF architecture}; the export reads it after hf_config.json
MODEL_FAMILY_IN_CHECKPOINT = "model_family.json"
#: files that make an HF directory's tokenizer loadable by ``HuggingFaceTokenizer``
_HF_TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json")


class SavedModel(Protocol):
    """A model rebuilt from a longspan checkpoint (``model_loading.LoadedModel`` is one)."""

    cfg: ConfigContainer
    model: list[nn.Module]
    tokenizer: Any
    iteration: int
    directory: Path


class CheckpointFormat(Protocol):
    """Writes and reads model-only longspan checkpoints; the training layer provides the implementation."""

    def save_model(self, cfg: ConfigContainer, model: list[nn.Module], parallel: Any) -> Path:
        """Write ``model``'s weights (no optimizer or RNG state), ``cfg`` as run_config.yaml and its tokenizer's
        files as the checkpoint of iteration 0 under ``cfg.checkpoint.save``. Collective; returns the iteration
        directory."""
        ...

    def load_model(self, path: str | os.PathLike, overrides: Sequence[str]) -> SavedModel:
        """The model of the checkpoint at ``path`` (a save root or an ``iter_`` directory) with dotlist
        ``overrides`` applied to its run_config.yaml: under a launch built for the saved layout (overrides
        applied), on one process whole; adapter checkpoints come back merged. Runs on every rank."""
        ...


def import_config(provider: Any, hf_path: str | os.PathLike, output: str | os.PathLike,
                  overrides: Sequence[str] = ()) -> ConfigContainer:
    """The run configuration an imported checkpoint carries, from the HF directory alone (no recipe).

    ``model`` is ``provider`` (the HF config.json's architecture and dtype); the tokenizer is the directory's
    HF tokenizer, or a ``NullTokenizer`` of the model's vocabulary when it has none; ``checkpoint.save`` is
    ``output`` with weights only. ``train.micro_batch_size=1`` sizes the activations between pipeline stages
    when the checkpoint is built for a pipeline layout; a run's own sections replace all of these. ``overrides``
    (dotlist, e.g. ``model.tensor_model_parallel_size=2``, ``model.seq_length=4096``) apply last.
    """
    hf_dir = Path(hf_path)
    if any((hf_dir / name).is_file() for name in _HF_TOKENIZER_MARKERS):
        tokenizer = TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(hf_dir.resolve()))
    else:
        tokenizer = TokenizerConfig(tokenizer_type="NullTokenizer")
    cfg = ConfigContainer(
        model=provider,
        train=TrainingConfig(micro_batch_size=1),
        tokenizer=tokenizer,
        checkpoint=CheckpointConfig(save=str(output), save_optim=False, save_rng=False),
    )
    apply_overrides(cfg, overrides)
    if cfg.tokenizer.tokenizer_type == "NullTokenizer" and cfg.tokenizer.vocab_size is None:
        cfg.tokenizer.vocab_size = cfg.model.vocab_size
    cfg.model.finalize()
    return cfg


def write_model_family(directory: str | os.PathLike, family: str) -> None:
    """Record in checkpoint directory ``directory`` that its model is built as HF family ``family``."""
    record = {"family": family, "architecture": family_named(family).architecture}
    (Path(directory) / MODEL_FAMILY_IN_CHECKPOINT).write_text(json.dumps(record, indent=2) + "\n")


def read_model_family(directory: str | os.PathLike) -> str | None:
    """The family checkpoint directory ``directory`` records (None when it has no record: older checkpoints)."""
    path = Path(directory) / MODEL_FAMILY_IN_CHECKPOINT
    if not path.is_file():
        return None
    try:
        family = json.loads(path.read_text()).get("family")
    except (ValueError, AttributeError) as exc:
        raise CheckpointError(f"{path} is not a model family record ({exc})") from None
    if not isinstance(family, str) or not family:
        raise CheckpointError(f"{path} names no model family: expected {{\"family\": <name>, ...}}")
    return family


class ProgressLog(Progress):
    """Tensors loaded or written by an HF import/export (called with each tensor's name): a bar on a terminal,
    a line every 10% elsewhere (``longspan.core.progress``)."""

    def __init__(self, total: int, desc: str, enabled: bool = True) -> None:
        super().__init__(total, desc, unit="tensors", enabled=enabled)

    def __call__(self, _name: str) -> None:
        self.advance()


__all__ = ["CheckpointFormat", "HF_CONFIG_IN_CHECKPOINT", "MODEL_FAMILY_IN_CHECKPOINT", "ProgressLog", "SavedModel",
           "import_config", "read_model_family", "write_model_family"]
