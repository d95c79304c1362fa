"""Vocabulary padding, independent of the parallel layout."""

from __future__ import annotations


def calculate_padded_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int) -> int:
    """Round ``vocab_size`` up to a multiple of ``make_vocab_size_divisible_by``.

    Megatron also multiplies the divisor by the tensor-parallel size; longspan does not, so parameter shapes
    (and checkpoints) never depend on the layout. ``ConfigContainer.validate()`` checks that the padded size
    divides by the tensor-parallel size instead.
    """
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    multiple = max(1, make_vocab_size_divisible_by)
    return ((vocab_size + multiple - 1) // multiple) * multiple
