"""Inference: text generation with a KV cache (``longspan generate`` and ``generate(...)``).

May import: core, config, models, data, parallel, peft, conversion.
"""

from __future__ import annotations

from longspan.inference.text_generation import (
    GenerationResult,
    check_generation_args,
    generate,
    next_token_logits_processor,
)

__all__ = ["GenerationResult", "check_generation_args", "generate", "next_token_logits_processor"]
