"""``Qwen25VLModelProvider``: Qwen2.5-VL's configuration (Megatron Bridge's names); ``provide()`` builds
``longspan.families.qwen_vl.model.Qwen25VLModel``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Literal, Optional

import torch
import torch.nn.functional as F

from longspan.models.vlm.provider import VisionLanguageProvider, refuse_videos


def default_vision_config() -> dict[str, Any]:
    """The released Qwen2.5-VL models' vision encoder (HF ``Qwen2_5_VLVisionConfig``'s names); out_hidden_size
    is the 7B's hidden size."""
    return {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "in_channels": 3,
            "patch_size": 14, "temporal_patch_size": 2, "spatial_merge_size": 2, "window_size": 112,
            "fullatt_block_indexes": [7, 15, 23, 31], "out_hidden_size": 3584, "hidden_act": "silu",
            "tokens_per_second": 2}


@dataclass
class Qwen25VLModelProvider(VisionLanguageProvider):
    """Qwen2.5-VL: a Qwen2 language model fed by a ViT (window attention, 2-D RoPE) through a patch merger,
    with multimodal RoPE. The language model's fields are the GPT provider's, with Qwen2's defaults here."""

    normalization: Literal["LayerNorm", "RMSNorm"] = "RMSNorm"
    """The language model's norms: RMSNorm (Qwen2)."""

    activation_func: Callable = F.silu
    """The language model's MLP activation (gated): silu (Qwen2)."""

    gated_linear_unit: bool = True
    """The language model's MLP is gated (SwiGLU)."""

    add_bias_linear: bool = False
    """Biases on the language model's linear layers other than q/k/v: none in Qwen2."""

    add_qkv_bias: bool = True
    """Biases on the query/key/value projections (Qwen2)."""

    share_embeddings_and_output_weights: bool = False
    """Tie the output layer to the word embeddings (the 3B model does, the 7B and 72B do not)."""

    position_embedding_type: Literal["mrope"] = "mrope"
    """Multimodal RoPE (temporal / height / width position ids, ``mrope_section``): the only one Qwen2.5-VL has."""

    rotary_base: float = 1000000.0
    """Base of the language model's rotary frequencies (Qwen2.5-VL: 1e6)."""

    scatter_embedding_sequence_parallel: bool = False
    """Whether the embeddings are scattered across the sequence-parallel ranks right after the lookup: False,
    as the image embeddings are put into the whole sequence's embeddings first (the decoder's input is split
    before the first layer); True with sequence parallel is a one-line error."""

    mrope_section: list[int] = field(default_factory=lambda: [16, 24, 24])
    """The rotary frequency pairs per mRoPE axis (temporal, height, width); they sum to kv_channels / 2."""

    vision_config: dict[str, Any] = field(default_factory=default_vision_config)
    """The vision encoder and merger: HF ``Qwen2_5_VLVisionConfig``'s fields (depth, hidden_size,
    intermediate_size, num_heads, patch_size, temporal_patch_size, spatial_merge_size, window_size,
    fullatt_block_indexes, out_hidden_size = the language model's hidden_size, hidden_act, ...)."""

    bos_token_id: int = 151643
    """Beginning-of-sequence token id (recorded for the HF config)."""

    eos_token_id: int = 151645
    """End-of-sequence token id (recorded for the HF config)."""

    vision_start_token_id: int = 151652
    """``<|vision_start|>``, the token before an image's tokens (recorded for the HF config)."""

    vision_end_token_id: int = 151653
    """``<|vision_end|>``, the token after an image's tokens (recorded for the HF config)."""

    vision_token_id: int = 151654
    """``<|vision_pad|>`` (recorded for the HF config)."""

    image_token_id: int = 151655
    """``<|image_pad|>``: each merged image patch's place in the tokens; the model puts the patch's embedding
    there and numbers it with the patch's row and column."""

    video_token_id: int = 151656
    """``<|video_pad|>``: the token a video's merged patches are written as. Qwen2.5-VL has no video path here
    (a video part or a batch with ``video_grid_thw`` is a one-line error); Qwen3-VL and Qwen3.5 take videos."""

    freeze_language_model: bool = False
    """Train no parameter of the language model (embedding, decoder, output layer): requires_grad=False."""

    freeze_vision_model: bool = False
    """Train no parameter of the vision encoder (patch embedding and blocks)."""

    freeze_vision_projection: bool = False
    """Train no parameter of the patch merger (the projection into the language model)."""

    hf_architecture: ClassVar[str] = "Qwen2_5_VLForConditionalGeneration"

    def image_position_ids(self, tokens: torch.Tensor, image_grid_thw: Optional[torch.Tensor],
                           video_grid_thw: Optional[torch.Tensor] = None,
                           cu_seqlens: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """mRoPE's ``[3, b, s]`` position ids: each image's tokens numbered by their merged patch's row and
        column, packed documents each from 0 (``longspan.models.vlm.mrope``); videos are refused."""
        refuse_videos(self, video_grid_thw)
        from longspan.families.qwen_vl.vision import QwenVisionArgs  # keeps the provider free of model code
        from longspan.models.vlm.mrope import mrope_position_ids

        merge = QwenVisionArgs.from_dict(self.vision_config).spatial_merge_size
        positions, _ = mrope_position_ids(tokens, image_grid_thw, self.image_token_id, merge, cu_seqlens)
        return positions

    def build_model(self, pre_process: bool, post_process: bool, vp_stage: Optional[int],
                    layer_numbers: Optional[list[int]], materialize: bool) -> Any:
        """``Qwen25VLModel`` (see ``ModelProviderMixin``), with the freeze options applied."""
        from longspan.models.init import materialize_model  # keeps the providers (configs) free of the model code
        from longspan.families.qwen_vl.model import Qwen25VLModel, freeze

        with torch.device("meta"):
            model = Qwen25VLModel(self, pre_process, post_process, vp_stage, layer_numbers=layer_numbers)
        freeze(model, self.freeze_language_model, self.freeze_vision_model, self.freeze_vision_projection)
        return materialize_model(model, self) if materialize else model
