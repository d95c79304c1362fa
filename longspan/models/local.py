"""Computing with the part of a parameter this process holds.

Layers that split their own work by heads (the Mamba and gated DeltaNet mixers, the routed experts) read their
parameters' local shards and run plain tensor operations on them, rather than DTensor operations: the parallel
plan places the parameters, the layer finds its share in their shapes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this process holds: a DTensor's local shard (differentiable), else ``t``."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def local_linear(layer: nn.Module, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``layer`` applied to ``x`` with ``weight``, this process's part of its weight (no bias): ``x @ weight.T``,
    or, for a layer an adapter wraps (``longspan.peft``), its ``local_forward``, which adds the adapter's output
    computed on local tensors too."""
    local_forward = getattr(layer, "local_forward", None)
    return F.linear(x, weight) if local_forward is None else local_forward(x, weight)
