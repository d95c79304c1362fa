"""Hugging Face model directories inside training runs (the part of HF interop the trainer itself needs).

- ``apply_hf_pretrained_config(cfg)``: with ``checkpoint.pretrained_checkpoint`` an HF directory, the model
  architecture comes from its config.json (layout and precision fields of the recipe stay, and so does every
  value set on purpose that the weights do not contradict) and the tokenizer from its tokenizer files.
- ``load_hf_pretrained(directory, model)``: the HF weights into the built chunks (instead of a DCP load).
- ``save_hf_checkpoint(state, model, directory)``: ``checkpoint.also_save_hf_checkpoint``.

It sits below ``checkpointing``/``setup``/``model_loading`` (which call it) and imports none of them; the
checkpoint format of ``longspan convert`` / ``AutoBridge.import_ckpt`` lives in ``hf_checkpoint``, above them.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch

from longspan.config.explicit import mark_model_family
from longspan.conversion.bridge import AutoBridge, hf_pretrained_dir
from longspan.core.errors import ConfigError
from longspan.core.logging import get_logger, get_rank, print_rank_0
from longspan.core.model_parallel_config import PARALLEL_CONFIG_FIELDS
from longspan.data.tokenizers import HuggingFaceTokenizer
from longspan.models.vlm.provider import is_vision_language
from longspan.training.checkpointing.model_fields import (
    ModelFieldMerge,
    merge_pretrained_model_fields,
    vision_language_family_of,
)

logger = get_logger(__name__)

#: the HF directory ``also_save_hf_checkpoint`` writes inside each iter_XXXXXXX directory
HF_SUBDIR = "hf"

# Fields that are the run's own, never taken from an HF config.json: the layout and precision (the
# ModelParallelConfig fields), multi-token prediction (Megatron Bridge's recipes set mtp_num_layers: the HF
# directory's MTP layers load when the run asks for them and are skipped with one log line when it does not) and,
# for RoPE models, the training sequence length.
_RUN_FIELDS_MTP = ("mtp_num_layers", "mtp_loss_scaling_factor", "mtp_enabled")
_RUN_FIELDS_ROPE = ("seq_length",)
# T5's relative positions have no length limit either: the run's encoder and decoder lengths stay.
_RUN_FIELDS_RELATIVE = ("seq_length", "seq_length_dec", "max_position_embeddings")


def apply_hf_model_config(cfg: Any, hf_dir: str | os.PathLike) -> list[str]:
    """Set ``cfg.model``'s architecture from the HF config.json in ``hf_dir``; returns the changed fields.

    The run's own fields stay (layout, precision, multi-token prediction; ``seq_length`` for RoPE models) and so
    does every value set on purpose that the weights do not contradict (``merge_pretrained_model_fields``).
    """
    return merge_hf_model_config(cfg, hf_dir).changed


def hf_bridge(directory: str | os.PathLike, text_model: bool) -> AutoBridge:
    """The bridge of HF directory ``directory`` for a run whose model is a text model (``text_model``: a
    vision-language directory then imports its language model alone, ``Family.text_tower``) or not."""
    bridge = AutoBridge.from_hf_pretrained(directory)
    tower = bridge.family.text_tower
    return AutoBridge(bridge.hf_config, tower, directory) if text_model and tower is not None else bridge


def merge_hf_model_config(cfg: Any, hf_dir: str | os.PathLike) -> ModelFieldMerge:
    """``apply_hf_model_config``, returning which fields came from config.json and which were kept."""
    bridge = hf_bridge(hf_dir, text_model=not is_vision_language(cfg.model))
    hf_provider = bridge.to_megatron_provider(load_weights=False)
    run_fields = set(PARALLEL_CONFIG_FIELDS) | set(_RUN_FIELDS_MTP)
    if hf_provider.position_embedding_type in ("rope", "yarn"):
        run_fields |= set(_RUN_FIELDS_ROPE)
    if hf_provider.position_embedding_type == "relative":
        run_fields |= set(_RUN_FIELDS_RELATIVE)
    if type(cfg.model) is not type(hf_provider) and is_vision_language(cfg.model) and is_vision_language(hf_provider):
        cfg.model = vision_language_family_of(cfg, hf_provider, run_fields)
    if type(cfg.model) is not type(hf_provider):
        raise ConfigError(
            f"checkpoint.pretrained_checkpoint={str(hf_dir)!r} holds a {type(hf_provider).__name__} model but the "
            f"recipe's model is a {type(cfg.model).__name__}: use a recipe of the same family (e.g. tiny-t5 for T5)"
        )
    merge = merge_pretrained_model_fields(cfg, hf_provider, "config.json", str(hf_dir), run_fields)
    mark_model_family(cfg, bridge.family.name)  # the model is now built as the HF directory's family
    return merge


def apply_hf_pretrained_config(cfg: Any) -> bool:
    """With an HF directory as ``checkpoint.pretrained_checkpoint``: architecture and tokenizer from it.

    Returns whether it applied. The tokenizer becomes ``HuggingFaceTokenizer`` on the directory when it holds
    tokenizer files.
    """
    hf_dir = hf_pretrained_dir(cfg)
    if hf_dir is None:
        return False
    merge = merge_hf_model_config(cfg, hf_dir)
    if any((hf_dir / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        cfg.tokenizer.tokenizer_type = "HuggingFaceTokenizer"
        cfg.tokenizer.tokenizer_model = str(hf_dir)
    print_rank_0(f"pretrained_checkpoint {hf_dir} is a Hugging Face model: {merge.describe('its config.json')}",
                 logger)
    return True


def load_hf_pretrained(directory: str | os.PathLike, model: list[torch.nn.Module],
                       select: Callable[[str], bool] | None = None) -> int:
    """Load the HF weights of ``directory`` into the built chunks (any layout); returns the tensor count."""
    chunk = getattr(model[0], "module", model[0])  # getattr: DDP wraps the chunk, FSDP2 and plain ones do not
    config = getattr(chunk, "config", None)  # getattr: the models of every kind, not all keep their provider
    bridge = hf_bridge(directory, text_model=not is_vision_language(config))
    count = bridge.load_weights_into(model, select=select)
    print_rank_0(f"loaded Hugging Face weights from {directory} ({count} tensors) for finetuning; "
                 "starting at iteration 0", logger)
    return count


def save_hf_checkpoint(state: Any, model: list[torch.nn.Module], directory: str | os.PathLike) -> None:
    """``checkpoint.also_save_hf_checkpoint``: the model as an HF directory (collective; rank 0 writes)."""
    bridge = AutoBridge.for_run(state.cfg)
    bridge.save_hf_pretrained(model, directory)
    tokenizer = getattr(state, "tokenizer", None)
    if get_rank() == 0 and bridge.hf_path is None and isinstance(tokenizer, HuggingFaceTokenizer):
        tokenizer.save_files(str(directory))
