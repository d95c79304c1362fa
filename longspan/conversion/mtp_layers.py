"""Multi-token-prediction (MTP) layers in Hugging Face checkpoints (DeepSeek-V3, GLM-4.5): how many a checkpoint
declares and holds, how many a model asks for, and the one-line messages when they differ.

config.json's ``num_nextn_predict_layers`` declares the depths, stored after the decoder as
``model.layers.{num_hidden_layers + k}.*`` (``mapping.with_mtp``). The import sets ``mtp_num_layers`` from it
(``None`` when 0), as Megatron Bridge does, but counts only the depths the files hold: transformers'
``save_pretrained`` writes no MTP tensors while keeping ``num_nextn_predict_layers``, so a checkpoint saved by
transformers imports without MTP (one log line says so). A model may load fewer depths than the files hold (the
others are skipped with one log line: ``mtp_num_layers=None`` skips them all), never more (one-line
``CheckpointError``). The export writes the model's depths and sets ``num_nextn_predict_layers`` to their count.
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

from longspan.conversion.mapping import WeightMap, with_mtp
from longspan.conversion.safetensors_io import HFCheckpointReader
from longspan.core.errors import CheckpointError, NotSupportedError
from longspan.core.logging import get_logger, print_rank_0
from longspan.models.args import TransformerArgs

_log = get_logger(__name__)

#: the config.json key that counts the MTP layers stored after the decoder
HF_MTP_KEY = "num_nextn_predict_layers"
#: a tensor every stored MTP depth has (its input projection)
_DEPTH_MARKER = "eh_proj.weight"


def declared_depths(cfg: dict[str, Any]) -> int:
    """The MTP depths config.json ``cfg`` declares (0 without the key)."""
    return int(cfg.get(HF_MTP_KEY) or 0)


def mtp_weights_for(table: tuple[WeightMap, ...]) -> Callable[[dict[str, Any]], tuple[WeightMap, ...]]:
    """A family's ``weights_for``: ``table`` plus the MTP depths config.json declares."""

    def weights_for(cfg: dict[str, Any]) -> tuple[WeightMap, ...]:
        return with_mtp(table, int(cfg.get("num_hidden_layers") or 0), declared_depths(cfg),
                        bool(cfg.get("tie_word_embeddings", False)))

    return weights_for


def stored_depths(reader: HFCheckpointReader, cfg: dict[str, Any]) -> int:
    """How many of the declared depths the files hold (the first ``n`` whose input projection is there)."""
    first = int(cfg.get("num_hidden_layers") or 0)
    count = 0
    while count < declared_depths(cfg) and f"model.layers.{first + count}.{_DEPTH_MARKER}" in reader:
        count += 1
    return count


def importable_depths(reader: HFCheckpointReader, cfg: dict[str, Any], architecture: str) -> int | None:
    """``mtp_num_layers`` for an import of ``cfg``'s files: the depths they hold (None for none); one log line
    when config.json declares depths the files lack."""
    declared, held = declared_depths(cfg), stored_depths(reader, cfg)
    if held < declared:
        first = int(cfg["num_hidden_layers"])
        print_rank_0(f"{architecture}: config.json {HF_MTP_KEY}={declared} but {reader.directory} holds "
                     f"{held} multi-token-prediction layers (no model.layers.{first + held}.{_DEPTH_MARKER}; "
                     f"transformers' save_pretrained drops them): importing with mtp_num_layers={held or None}",
                     _log)
    return held or None


def model_depths(chunks: list[nn.Module]) -> int:
    """The MTP depths of a model (every pipeline stage's chunk knows the model's ``mtp_num_layers``)."""
    depths = 0
    for chunk in chunks:
        while isinstance(getattr(chunk, "module", None), nn.Module):  # a DDP wrapper
            chunk = chunk.module
        args = getattr(chunk, "args", None)  # a module attribute: T5's are T5Args, a vision-language model has none
        if isinstance(args, TransformerArgs):
            depths = max(depths, int(args.mtp_num_layers or 0))
    return depths


def check_import(reader: HFCheckpointReader, cfg: dict[str, Any], requested: int, architecture: str) -> None:
    """A model asking for ``requested`` depths loads from these files: one-line ``CheckpointError`` when they
    hold fewer, one log line naming the stored depths it leaves out."""
    held = stored_depths(reader, cfg)
    if requested > held:
        raise CheckpointError(
            f"model.mtp_num_layers={requested} asks for more multi-token-prediction layers than {reader.directory} "
            f"holds ({held}; {architecture} config.json {HF_MTP_KEY}={declared_depths(cfg)}): set "
            f"mtp_num_layers={held or None}"
        )
    if requested < held:
        first = int(cfg["num_hidden_layers"]) + requested
        print_rank_0(f"{architecture}: the multi-token-prediction layers model.layers.{first}.."
                     f"{first + held - requested - 1} of {reader.directory} are not imported (model.mtp_num_layers="
                     f"{requested or None})", _log)


def check_export(family_mtp: bool, depths: int, architecture: str) -> None:
    """One-line ``NotSupportedError`` for a model with MTP depths exported as an architecture without them."""
    if depths and not family_mtp:
        raise NotSupportedError(
            f"{architecture} has no multi-token-prediction layers: a model with mtp_num_layers={depths} exports "
            "only as an architecture that stores them (a family with mtp_layers)"
        )


def with_depths(cfg: dict[str, Any], depths: int) -> dict[str, Any]:
    """config.json ``cfg`` declaring ``depths`` MTP layers."""
    return {**cfg, HF_MTP_KEY: int(depths)}
