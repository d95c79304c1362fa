"""longspan: Megatron Bridge's training layer on PyTorch's own distributed engine."""

__version__ = "0.1.0"
