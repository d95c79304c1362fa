"""Activation functions beyond torch.nn.functional's plain names (allowlisted in longspan.config.targets)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation (GPT-2's ``gelu_new``, Megatron's ``openai_gelu``)."""
    return F.gelu(x, approximate="tanh")


def squared_relu(x: torch.Tensor) -> torch.Tensor:
    """``relu(x)²`` (Megatron's ``squared_relu``, HF's ``relu2``: Nemotron-H's MLP activation)."""
    return F.relu(x).square()
