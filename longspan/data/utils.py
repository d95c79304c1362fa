"""Small shared pieces of the data layer: splits, blends, weights and rank coordination."""

from __future__ import annotations

import math
import re
from enum import Enum
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch.distributed as dist

from longspan.core.errors import DataError

Blend = Tuple[List[str], Optional[List[float]]]


class Split(Enum):
    """The three dataset splits, in Megatron's order."""

    train = 0
    valid = 1
    test = 2


def normalize(weights: Sequence[float]) -> List[float]:
    """Weights divided by their sum (Megatron's non-exponentiated normalization)."""
    w = np.asarray(weights, dtype=np.float64)
    return (w / np.sum(w)).tolist()


def check_weights(weights: Optional[Sequence[float]], field: str) -> None:
    """Raise DataError for negative, non-finite or all-zero blend weights."""
    if weights is None:
        return
    w = [float(x) for x in weights]
    bad = [x for x in w if not math.isfinite(x) or x < 0]
    if bad:
        raise DataError(f"{field}: blend weight {bad[0]} is invalid; weights must be finite and >= 0")
    if not any(x > 0 for x in w):
        raise DataError(f"{field}: blend weights {w} are all zero; at least one must be > 0")


def parse_split(split: str, field: str = "dataset.split") -> List[float]:
    """``"969,30,1"`` -> normalized [train, valid, test] weights (missing entries are 0)."""
    text = str(split)
    try:
        parts = [float(x) for x in re.findall(r"[-.0-9eE]+", text)]
    except ValueError:
        parts = []
    if not parts or len(parts) > 3:
        raise DataError(f"{field}={text!r} is not a split; expected up to three weights such as '969,30,1'")
    if any(p < 0 or not math.isfinite(p) for p in parts) or sum(parts) <= 0:
        raise DataError(f"{field}={text!r}: split weights must be >= 0 with a positive sum")
    parts = parts + [0.0] * (3 - len(parts))
    return normalize(parts)


def split_matrix(vector: Sequence[float]) -> List[Optional[Tuple[float, float]]]:
    """Normalized split weights -> the [lo, hi) bookends of each split (None for an empty split)."""
    bounds = [0.0]
    for v in vector:
        bounds.append(bounds[-1] + v)
    matrix: List[Optional[Tuple[float, float]]] = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        matrix.append(None if hi <= lo else (lo, hi))
    return matrix


def split_bounds(bookend: Tuple[float, float], num_elements: int) -> Tuple[int, int]:
    """Element range ``[round(lo*N), round(hi*N))`` of one split (Python's round, as Megatron)."""
    return int(round(bookend[0] * float(num_elements))), int(round(bookend[1] * float(num_elements)))


def parse_blend_string(text: str, field: str = "dataset.data_path") -> Blend:
    """``"PREFIX"``, ``"P1 P2"`` or ``"0.3 P1 0.7 P2"`` -> (prefixes, weights or None)."""
    tokens = text.split() if isinstance(text, str) else [str(t) for t in text]
    if not tokens:
        raise DataError(f"{field} is empty; give a prefix, 'W1 P1 W2 P2', or builtin:stdlib")
    if len(tokens) % 2 == 0:
        try:
            weights = [float(tokens[i]) for i in range(0, len(tokens), 2)]
            prefixes = [tokens[i + 1] for i in range(0, len(tokens), 2)]
        except ValueError:
            weights, prefixes = None, tokens
    else:
        weights, prefixes = None, tokens
    if weights is None:
        for t in prefixes:
            try:
                float(t)
            except ValueError:
                continue
            raise DataError(f"{field}={text!r}: a weight without a prefix; expected 'W1 P1 W2 P2 ...'")
    check_weights(weights, field)
    return prefixes, weights


def barrier_if_distributed() -> None:
    """torch.distributed barrier when a process group is up; a no-op otherwise."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def dist_rank() -> int:
    """Rank in the default process group, 0 without one."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
