"""``checkpoint.dist_ckpt_strictness``: what a load does when checkpoint and model name different tensors.

Megatron's names (megatron-core ``StrictHandling``): *unexpected* keys are tensors the model asks for that the
checkpoint lacks, *missing* keys are tensors the checkpoint holds that the model lacks.

- ``assume_ok_unexpected`` (default): no check beforehand; a tensor the checkpoint lacks stops the load with an
  error naming it, checkpoint tensors the model lacks are not read.
- ``log_unexpected`` / ``log_all``: a warning lists the unexpected keys (``_all``: and the missing ones); the
  tensors the checkpoint lacks keep their current values.
- ``raise_unexpected`` / ``raise_all``: one error line naming the unexpected keys (``_all``: or missing ones).
- ``return_unexpected`` / ``return_all``: nothing reported; the keys are returned with the loaded checkpoint
  (``LoadedCheckpoint.unexpected_keys`` / ``missing_keys``); tensors the checkpoint lacks keep their values.
- ``ignore_all``: tensors the checkpoint lacks keep their values, nothing is reported.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from longspan.core.errors import CheckpointError
from longspan.core.logging import get_logger

logger = get_logger(__name__)

_SKIPPING = ("log_unexpected", "log_all", "return_unexpected", "return_all", "ignore_all")


def _names(keys: list[str], limit: int = 5) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def key_mismatch(model_sd: dict[str, Any], stored: set[str]) -> tuple[list[str], list[str]]:
    """(unexpected, missing): model tensors absent from the checkpoint, checkpoint model tensors the model lacks."""
    unexpected = sorted(k for k, v in model_sd.items() if isinstance(v, torch.Tensor) and f"model.{k}" not in stored)
    wanted = set(model_sd)
    missing = sorted(name for name in (k[len("model."):] for k in stored if k.startswith("model."))
                     if name not in wanted and not any(name.startswith(w + ".") for w in wanted))
    return unexpected, missing


def apply_strictness(mode: str, model_sd: dict[str, Any], stored: set[str],
                     directory: Path) -> tuple[dict[str, Any], list[str], list[str]]:
    """The model tensors to load under ``mode``, and the (unexpected, missing) keys it returns."""
    if mode == "assume_ok_unexpected":
        return model_sd, [], []
    unexpected, missing = key_mismatch(model_sd, stored)
    if mode.endswith("_unexpected"):
        missing = []  # megatron-core does not look for them in these modes
    field = f"checkpoint.dist_ckpt_strictness={mode!r}"
    if mode.startswith("raise") and (unexpected or missing):
        parts = [f"the model's tensors {_names(unexpected)} are not in it"] if unexpected else []
        parts += [f"its tensors {_names(missing)} are not in the model"] if missing else []
        raise CheckpointError(f"checkpoint {directory} does not match the model ({field}): {'; '.join(parts)}")
    if mode.startswith("log") and (unexpected or missing):
        logger.warning(f"checkpoint {directory} ({field}): model tensors not in it, kept as they are: "
                       f"{_names(unexpected) or 'none'}; its tensors not in the model: {_names(missing) or 'none'}")
    if mode in _SKIPPING:
        model_sd = {k: v for k, v in model_sd.items() if k not in set(unexpected)}
    if mode == "ignore_all":
        return model_sd, [], []
    return model_sd, unexpected, missing
