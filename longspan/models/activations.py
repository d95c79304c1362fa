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


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(1.702 x)`` (Megatron's ``quick_gelu``; GPT-OSS's experts with HF ``swiglu_alpha=1.702``)."""
    return x * torch.sigmoid(x * 1.702)


def gated_activation(gate: torch.Tensor, up: torch.Tensor, activation_func, linear_offset: float = 0.0,
                     clamp_value: float | None = None) -> torch.Tensor:
    """A gated linear unit's hidden ``act(gate) * (up + linear_offset)``; with ``clamp_value`` the gate is first
    clamped above at it and ``up`` to ``[-clamp_value, clamp_value]`` (Megatron's ``glu_linear_offset`` and
    ``activation_func_clamp_value``; GPT-OSS's clamped SwiGLU)."""
    if clamp_value is not None:
        gate = gate.clamp(max=clamp_value)
        up = up.clamp(min=-clamp_value, max=clamp_value)
    if linear_offset:
        up = up + linear_offset
    return activation_func(gate) * up
