"""The bottom layer: the error types (one-line errors for people), rank-aware logging, the Megatron Core
``ModelParallelConfig`` and vocabulary padding. It imports no other longspan package."""
