"""Vision-language models: the shared pieces of vision encoders feeding longspan's GPT language model.

``provider.VisionLanguageProvider`` (the providers' base), ``mrope`` (multimodal RoPE and its position ids) and
``GPTModel.forward(decoder_input=...)`` (embeddings computed by the caller, e.g. with image embeddings put in);
``models.sliding_window.TwoSidedMask`` lets the tokens of one image attend to each other both ways. The
families' encoders and providers live in their packages (``longspan.families``) and are found here by name
(``longspan.models.vlm.<Family>ModelProvider``).

Importing this package loads the providers' base only; the model code loads when a model is built.
"""

from __future__ import annotations

from typing import Any

from longspan.config.targets import registered_class
from longspan.models.vlm.provider import VisionLanguageProvider, is_vision_language

__all__ = ["VisionLanguageProvider", "is_vision_language"]


def __getattr__(name: str) -> Any:
    # A family's vision-language provider, registered by its package (dunder probes never load the families).
    cls = None if name.startswith("__") else registered_class(name, "longspan.models")
    if cls is not None and issubclass(cls, VisionLanguageProvider):
        return cls
    raise AttributeError(f"module 'longspan.models.vlm' has no attribute {name!r}")
