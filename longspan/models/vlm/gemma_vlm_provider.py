"""``Gemma3VLModelProvider``: Gemma 3's vision-language model (Megatron Bridge's name and fields); ``provide()``
builds ``longspan.models.vlm.gemma_vlm.Gemma3VLModel``.

The GPT fields describe the language model (Gemma 3's text tower); ``vision_config`` the SigLIP encoder (HF's
``SiglipVisionConfig`` fields, as in config.json); ``mm_tokens_per_image`` how many soft tokens each image
becomes after average pooling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from longspan.core.errors import ConfigError, NotSupportedError
from longspan.models.gpt_provider import GPTModelProvider

#: SigLIP vision_config values the vision tower implements (anything else: NotSupportedError when built)
SUPPORTED_VISION_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_new", "gelu")


@dataclass
class Gemma3VLModelProvider(GPTModelProvider):
    """A Gemma 3 vision-language model: SigLIP encoder, multimodal projector, Gemma 3 language model.

    Tested on one process; the data-parallel wrappers apply as to any model (FSDP2 shards it as one unit: it
    has no top-level ``decoder.layers``). Tensor, context and pipeline parallel raise a one-line
    NotSupportedError when the model is built."""

    vision_config: dict[str, Any] = field(default_factory=dict)
    """The SigLIP vision encoder: HF ``SiglipVisionConfig`` fields (``hidden_size``, ``intermediate_size``,
    ``num_hidden_layers``, ``num_attention_heads``, ``num_channels``, ``image_size``, ``patch_size``,
    ``layer_norm_eps``, ``hidden_act``); ``vision_use_head`` must be false (Gemma 3 uses every patch)."""

    mm_tokens_per_image: int = 256
    """Soft tokens per image: the encoder's ``(image_size / patch_size)^2`` patch vectors are average-pooled to
    this many (a square number whose side divides the patch grid's), normed and projected to the LM's width."""

    bos_token_id: int = 2
    """The tokenizer's beginning-of-sequence id (recorded for the export; the model does not read it)."""

    eos_token_id: Union[int, list[int]] = 1
    """The end-of-sequence id(s) (recorded for the export; generation stops at the tokenizer's)."""

    vision_start_token_id: int = 255999
    """``<start_of_image>`` (HF ``boi_token_index``): an ordinary text token before each image's soft tokens."""

    vision_end_token_id: int = 256000
    """``<end_of_image>`` (HF ``eoi_token_index``): an ordinary text token after each image's soft tokens."""

    image_token_id: int = 262144
    """``<image_soft_token>`` (HF ``image_token_index``): the positions whose embeddings become the image's
    projected vectors, in order. An id beyond the vocabulary is embedded as id 0 before it is replaced."""

    freeze_language_model: bool = False
    """Train no language-model parameter (``requires_grad=False`` on ``language_model.*``)."""

    freeze_vision_model: bool = False
    """Train no vision-encoder parameter (``vision_tower.*``)."""

    freeze_vision_projection: bool = False
    """Train no multimodal-projector parameter (``multi_modal_projector.*``)."""

    def check_vision(self) -> None:
        """One-line errors for vision fields the model cannot build."""
        vision = self.vision_config or {}
        for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "image_size",
                    "patch_size"):
            value = vision.get(key)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"model.vision_config.{key}={value!r} is invalid: give a positive integer")
        if vision.get("vision_use_head"):
            raise NotSupportedError("model.vision_config.vision_use_head=True is not supported: Gemma 3 uses every "
                                    "patch vector (set it to false)")
        act = vision.get("hidden_act", "gelu_pytorch_tanh")
        if act not in SUPPORTED_VISION_ACTIVATIONS:
            raise NotSupportedError(f"model.vision_config.hidden_act={act!r} is not supported: use one of "
                                    f"{', '.join(SUPPORTED_VISION_ACTIVATIONS)}")
        if vision["hidden_size"] % vision["num_attention_heads"]:
            raise ConfigError(f"model.vision_config.hidden_size={vision['hidden_size']} is not a multiple of "
                              f"num_attention_heads={vision['num_attention_heads']}")
        grid = vision["image_size"] // vision["patch_size"]
        side = math.isqrt(self.mm_tokens_per_image) if self.mm_tokens_per_image > 0 else 0
        if side * side != self.mm_tokens_per_image or grid % side:
            raise ConfigError(
                f"model.mm_tokens_per_image={self.mm_tokens_per_image} is invalid: give a square number whose "
                f"side divides the {grid}x{grid} patch grid (image_size // patch_size)"
            )

    def check_layout(self, pre_process: bool, post_process: bool, layer_numbers: Optional[list[int]]) -> None:
        """One-line NotSupportedError for the parallel layouts not implemented yet."""
        for name in ("tensor_model_parallel_size", "context_parallel_size", "pipeline_model_parallel_size"):
            value = getattr(self, name, 1) or 1
            if value > 1:
                raise NotSupportedError(f"model.{name}={value} is not supported yet for Gemma3VLModelProvider: "
                                        "use 1 (data parallel works)")
        if not (pre_process and post_process) or layer_numbers is not None:
            raise NotSupportedError("pipeline stages are not supported yet for Gemma3VLModelProvider")

    def build_model(self, pre_process: bool, post_process: bool, vp_stage: Optional[int],
                    layer_numbers: Optional[list[int]], materialize: bool) -> Any:
        """``longspan.models.vlm.gemma_vlm.build_gemma3_vl_model`` (see ``ModelProviderMixin``)."""
        from longspan.models.vlm.gemma_vlm import build_gemma3_vl_model  # keeps the provider free of model code

        self.check_layout(pre_process, post_process, layer_numbers)
        self.check_vision()
        return build_gemma3_vl_model(self, vp_stage, materialize=materialize)


__all__ = ["Gemma3VLModelProvider"]
