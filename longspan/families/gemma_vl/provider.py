"""``Gemma3VLModelProvider``: Gemma 3's vision-language model (Megatron Bridge's name and fields); ``provide()``
builds ``longspan.families.gemma_vl.model.Gemma3VLModel``.

The GPT fields describe the language model (Gemma 3's text tower); ``vision_config`` the SigLIP encoder (HF's
``SiglipVisionConfig`` fields, as in config.json); ``mm_tokens_per_image`` how many soft tokens each image
becomes after average pooling.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional, Union

from longspan.config.rules.vision import check_image_model
from longspan.models.vlm.provider import VisionLanguageProvider


@dataclass
class Gemma3VLModelProvider(VisionLanguageProvider):
    """A Gemma 3 vision-language model: SigLIP encoder, multimodal projector, Gemma 3 language model.

    Layouts: data parallel and FSDP2 (the language model's layers sharded one by one, the vision encoder in
    the root unit) and tensor parallel (the language model split, the encoder and projector replicated on every
    rank) and pipeline parallel (the encoder and projector on the first stage); sequence and context parallel
    split the sequence after the image merge (the image blocks' two-way mask keeps whole-sequence key columns).
    The image fields are checked by ``longspan.config.rules.vision``, in ``validate()`` and when the model is
    built."""

    scatter_embedding_sequence_parallel: bool = False
    """Whether the embeddings are scattered across the sequence-parallel ranks right after the lookup: False, as
    the image embeddings are put into the whole sequence's embeddings first (the decoder's input is split
    before the first layer); True with sequence parallel is a one-line error."""

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

    hf_architecture: ClassVar[str] = "Gemma3ForConditionalGeneration"

    def build_model(self, pre_process: bool, post_process: bool, vp_stage: Optional[int],
                    layer_numbers: Optional[list[int]], materialize: bool) -> Any:
        """``longspan.families.gemma_vl.model.build_gemma3_vl_model`` (see ``ModelProviderMixin``)."""
        from longspan.families.gemma_vl.model import build_gemma3_vl_model  # keeps the provider free of model code

        check_image_model(self)
        return build_gemma3_vl_model(self, vp_stage, materialize=materialize, pre_process=pre_process,
                                     post_process=post_process, layer_numbers=layer_numbers)


__all__ = ["Gemma3VLModelProvider"]
