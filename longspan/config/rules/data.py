"""Data and tokenizer rules: data paths, blends and splits, the dataset's sequence length against the model's
(``ConfigContainer.validate()``), and the model vocabulary against the tokenizer's (checked at setup).
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Optional

from longspan.config.schema.data import FinetuningDatasetConfig, GPTDatasetConfig
from longspan.core.errors import ConfigError

if TYPE_CHECKING:
    from longspan.config.schema.container import ConfigContainer


_SPLIT_RE = re.compile(r"^\s*\d+(\.\d*)?(\s*[,/]\s*\d+(\.\d*)?){0,2}\s*$")


def check_blend(blend: object, name: str) -> None:
    """A blend is [paths, weights or None] with one positive weight per path."""
    ok = isinstance(blend, (list, tuple)) and len(blend) == 2 and isinstance(blend[0], (list, tuple))
    ok = ok and len(blend[0]) > 0 and all(isinstance(p, str) for p in blend[0])
    if ok and blend[1] is not None:
        w = blend[1]
        ok = isinstance(w, (list, tuple)) and len(w) == len(blend[0])
        ok = ok and all(isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0 for x in w)
        ok = ok and sum(w) > 0
    if not ok:
        raise ConfigError(
            f"{name}={blend!r} is not a blend: use [[PREFIX, ...], null] or [[P1, P2], [W1, W2]] with weights >= 0"
        )


def check_data_path(data_path: str) -> None:
    """'PREFIX', 'builtin:NAME' or 'W1 P1 W2 P2 ...' (positive weights, one per prefix)."""
    parts = data_path.split()
    if not parts:
        raise ConfigError("dataset.data_path='' is empty: give a prefix, 'W1 P1 W2 P2', or builtin:NAME")
    if len(parts) == 1:
        return
    weights = parts[0::2]
    try:
        values = [float(w) for w in weights]
    except ValueError:
        values = None
    if len(parts) % 2 != 0 or values is None or any(v < 0 or math.isnan(v) for v in values) or sum(values) <= 0:
        raise ConfigError(
            f"dataset.data_path={data_path!r} is not valid: use 'PREFIX' or weight/prefix pairs 'W1 P1 W2 P2' "
            "with non-negative weights"
        )


def check_dataset(cfg: "ConfigContainer") -> None:
    """GPT data: one data source, valid blends and split, its sequence length the model's; SFT data: the length."""
    d, m = cfg.dataset, cfg.model
    if isinstance(d, GPTDatasetConfig):
        if d.seq_length is not None:  # current Megatron Bridge's name for sequence_length
            d.sequence_length = d.seq_length
        if d.sequence_length != m.seq_length:
            raise ConfigError(
                f"dataset.sequence_length={d.sequence_length} differs from model.seq_length={m.seq_length}: "
                "set both to the same value"
            )
        if d.data_path is not None and d.blend is not None:
            raise ConfigError("dataset.data_path and dataset.blend are both set: use one of them")
        if d.blend_per_split is not None and (d.blend is not None or d.data_path is not None):
            raise ConfigError("dataset.blend_per_split cannot be combined with dataset.blend or dataset.data_path")
        if d.data_path is not None:
            check_data_path(d.data_path)
        if d.blend is not None:
            check_blend(d.blend, "dataset.blend")
        if d.blend_per_split is not None:
            if len(d.blend_per_split) != 3:
                raise ConfigError(
                    f"dataset.blend_per_split has {len(d.blend_per_split)} entries: give 3 (train, valid, test)"
                )
            for i, b in enumerate(d.blend_per_split):
                if b is not None:
                    check_blend(b, f"dataset.blend_per_split[{i}]")
        if d.split is not None:
            if not _SPLIT_RE.match(d.split) or sum(float(x) for x in re.split(r"[,/]", d.split)) <= 0:
                raise ConfigError(
                    f"dataset.split={d.split!r} is not valid: use up to three non-negative numbers like '969,30,1'"
                )
    elif isinstance(d, FinetuningDatasetConfig) and d.seq_length is not None and d.seq_length != m.seq_length:
        raise ConfigError(
            f"dataset.seq_length={d.seq_length} differs from model.seq_length={m.seq_length}: set both the same"
        )


def check_vocab_fits(model_vocab_size: Optional[int], tokenizer_vocab_size: int) -> None:
    """The model's vocabulary must hold every id the tokenizer can produce (never padded or cut silently)."""
    if model_vocab_size is not None and model_vocab_size < tokenizer_vocab_size:
        raise ConfigError(
            f"model.vocab_size={model_vocab_size} is smaller than the tokenizer's vocabulary ({tokenizer_vocab_size} "
            f"ids): set model.vocab_size >= {tokenizer_vocab_size} or null (taken from the tokenizer)"
        )


def check_masking_choices(d: object) -> None:
    """Masked-LM (T5) data: the n-gram permutation draws 1/n sizes, so it cannot run with the geometric ones
    (megatron-core asserts the same)."""
    if getattr(d, "masking_do_permutation", False) and getattr(d, "masking_use_geometric_distribution", False):
        raise ConfigError(
            "dataset.masking_do_permutation=True with dataset.masking_use_geometric_distribution=True: the "
            "permutation draws 1/n n-gram sizes; set masking_use_geometric_distribution=False or drop the permutation"
        )


def check_dataset_masking(cfg: "ConfigContainer") -> None:
    """The dataset's masking choices (T5 data; other datasets have no masking fields)."""
    check_masking_choices(cfg.dataset)
