"""``VisionLanguageProvider``: the base of the vision-language providers (a vision encoder feeding the GPT
language model). Shared code asks the provider what it needs (``hf_architecture``, ``image_position_ids``) and
tells these providers apart with ``is_vision_language``, never by family; the families' providers live in their
packages (``longspan.families``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import torch

from longspan.core.errors import DataError
from longspan.models.gpt_provider import GPTModelProvider


#: why the vision-language providers do not support the multi-token-prediction fields (their support rows)
NO_MTP_REASON = "multi-token prediction is a GPT text-model head; the vision-language models have none"


@dataclass
class VisionLanguageProvider(GPTModelProvider):
    """A vision-language model's provider: the GPT fields describe its language model; a subclass adds the vision
    encoder's fields (``vision_config``, the image token ids, the ``freeze_*`` options) and builds the model."""

    hf_architecture: ClassVar[str] = ""
    """The HF architecture a model of this provider exports as when the checkpoint does not say."""

    def image_position_ids(self, tokens: torch.Tensor, image_grid_thw: Optional[torch.Tensor],
                           video_grid_thw: Optional[torch.Tensor] = None,
                           cu_seqlens: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """Position ids of a batch whose images (and videos) are described by ``image_grid_thw``
        (``video_grid_thw``: the HF processor's patch grids), computed outside the model so every pipeline stage
        gets the same ids; None: the batch's own. ``cu_seqlens [b, n + 1]``: the rows are packed documents (each
        one's first position, then the length), each numbered from 0 as if alone. A provider without a video path
        refuses ``video_grid_thw``."""
        refuse_videos(self, video_grid_thw)
        return None


def refuse_videos(provider: Any, video_grid_thw: Optional[torch.Tensor]) -> None:
    """One-line DataError when a batch for a provider without a video path has videos."""
    if video_grid_thw is not None:
        raise DataError(f"{type(provider).__name__} has no video path: the batch has videos (video_grid_thw); "
                        "give images and text only")


def is_vision_language(provider: Any) -> bool:
    """A vision-language provider (a ``VisionLanguageProvider``)."""
    return isinstance(provider, VisionLanguageProvider)


__all__ = ["NO_MTP_REASON", "VisionLanguageProvider", "is_vision_language", "refuse_videos"]
