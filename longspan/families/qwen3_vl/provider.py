"""``Qwen3VLModelProvider`` and ``Qwen3VLMoEModelProvider`` (Megatron Bridge's names): Qwen3-VL's configuration;
``provide()`` builds ``longspan.families.qwen3_vl.model.Qwen3VLModel``. The fields are Qwen2.5-VL's
(``Qwen25VLModelProvider``) with Qwen3's language model and Qwen3-VL's encoder as defaults."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Literal, Optional

import torch
import torch.nn.functional as F

from longspan.families.qwen_vl.provider import Qwen25VLModelProvider


def default_vision_config() -> dict[str, Any]:
    """The released Qwen3-VL models' encoder (HF ``Qwen3VLVisionConfig``'s names); out_hidden_size is the 8B's
    hidden size."""
    return {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16, "in_channels": 3,
            "patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 4096,
            "num_position_embeddings": 2304, "deepstack_visual_indexes": [8, 16, 24],
            "hidden_act": "gelu_pytorch_tanh", "rope_theta": 10000.0}


@dataclass
class Qwen3VLModelProvider(Qwen25VLModelProvider):
    """Qwen3-VL: a Qwen3 language model (per-head QK-norm, no biases) fed by a ViT with learned position
    embeddings and 2-D RoPE through a patch merger, DeepStack features added after the first decoder layers, and
    interleaved multimodal RoPE."""

    normalization: Literal["LayerNorm", "RMSNorm"] = "RMSNorm"
    """The language model's norms: RMSNorm (Qwen3)."""

    activation_func: Callable = F.silu
    """The language model's MLP activation (gated): silu (Qwen3)."""

    gated_linear_unit: bool = True
    """The language model's MLP is gated (SwiGLU)."""

    add_bias_linear: bool = False
    """Biases on the language model's linear layers other than q/k/v: none in Qwen3."""

    add_qkv_bias: bool = False
    """Biases on the query/key/value projections: none in Qwen3."""

    share_embeddings_and_output_weights: bool = False
    """Tie the output layer to the word embeddings (the 2B and 4B models do, the 8B and larger do not)."""

    qk_layernorm: bool = True
    """Per-head RMSNorm of the queries and keys (Qwen3)."""

    rotary_base: float = 5000000.0
    """Base of the language model's rotary frequencies (Qwen3-VL: 5e6)."""

    position_embedding_type: Literal["mrope"] = "mrope"
    """Interleaved multimodal RoPE (temporal / height / width position ids, ``mrope_section``): Qwen3-VL's only
    one."""

    mrope_section: list[int] = field(default_factory=lambda: [24, 20, 20])
    """The rotary frequency pairs per mRoPE axis (temporal, height, width), interleaved pair by pair (pair i is
    height's when i % 3 == 1 and i < 3 * mrope_section[1], width's when i % 3 == 2 and i < 3 * mrope_section[2],
    temporal's otherwise: every pair has an axis whatever they sum to)."""

    vision_config: dict[str, Any] = field(default_factory=default_vision_config)
    """The encoder, merger and DeepStack mergers: HF ``Qwen3VLVisionConfig``'s fields (depth, hidden_size,
    intermediate_size, num_heads, patch_size, temporal_patch_size, spatial_merge_size, num_position_embeddings,
    deepstack_visual_indexes: the encoder blocks whose features are added after decoder layers 0, 1, ...,
    out_hidden_size = the language model's hidden_size, hidden_act)."""

    video_token_id: int = 151656
    """``<|video_pad|>``: each merged patch of a video frame's place in the tokens (the processor writes each
    frame's timestamp and ``<|vision_start|>`` before it); the model puts the patch's embedding there."""

    freeze_vision_model: bool = False
    """Train no parameter of the vision encoder (patch embedding, position embeddings and blocks)."""

    freeze_vision_projection: bool = False
    """Train no parameter of the projections into the language model: the patch merger and the DeepStack
    mergers."""

    hf_architecture: ClassVar[str] = "Qwen3VLForConditionalGeneration"

    mrope_interleaved: ClassVar[bool] = True
    """The mRoPE table interleaves the axes pair by pair over the first ``rotary_percent`` of each head (Qwen3.5's
    partial RoPE), so ``mrope_section`` need not sum to the pairs; the shared model rules read it."""

    def image_position_ids(self, tokens: torch.Tensor, image_grid_thw: Optional[torch.Tensor],
                           video_grid_thw: Optional[torch.Tensor] = None,
                           cu_seqlens: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """Interleaved mRoPE's ``[3, b, s]`` position ids of a batch with images and videos (packed documents each
        from 0)."""
        # function-level imports keep the provider (a config) free of the model code
        from longspan.families.qwen3_vl.positions import qwen3_vl_position_ids
        from longspan.families.qwen3_vl.vision import Qwen3VisionArgs

        merge = Qwen3VisionArgs.from_dict(self.vision_config).spatial_merge_size
        positions, _ = qwen3_vl_position_ids(tokens, image_grid_thw, video_grid_thw, self.image_token_id,
                                             self.video_token_id, merge, cu_seqlens)
        return positions

    def build_model(self, pre_process: bool, post_process: bool, vp_stage: Optional[int],
                    layer_numbers: Optional[list[int]], materialize: bool) -> Any:
        """``Qwen3VLModel`` (see ``ModelProviderMixin``), with the freeze options applied."""
        from longspan.families.qwen3_vl.model import Qwen3VLModel, freeze  # the provider stays free of model code
        from longspan.models.init import materialize_model  # the provider stays free of model code

        with torch.device("meta"):
            model = Qwen3VLModel(self, pre_process, post_process, vp_stage, layer_numbers=layer_numbers)
        freeze(model, self.freeze_language_model, self.freeze_vision_model, self.freeze_vision_projection)
        return materialize_model(model, self) if materialize else model


@dataclass
class Qwen3VLMoEModelProvider(Qwen3VLModelProvider):
    """Qwen3-VL with a Qwen3-MoE language model (the GPT provider's ``num_moe_experts`` / ``moe_*`` fields)."""

    hf_architecture: ClassVar[str] = "Qwen3VLMoeForConditionalGeneration"


@dataclass
class Qwen35VLModelProvider(Qwen3VLModelProvider):
    """Qwen3.5 with images and videos (``Qwen3_5ForConditionalGeneration``): Qwen3-VL's encoder without DeepStack
    on Qwen3.5's gated DeltaNet hybrid (the GPT provider's ``experimental_attention_variant`` and
    ``linear_*`` fields, partial interleaved mRoPE over ``rotary_percent`` of each head)."""

    hf_architecture: ClassVar[str] = "Qwen3_5ForConditionalGeneration"


@dataclass
class Qwen35VLMoEModelProvider(Qwen35VLModelProvider):
    """Qwen3.5-MoE with images and videos (``Qwen3_5MoeForConditionalGeneration``): experts (and a gated shared
    expert) on every layer of the hybrid."""

    hf_architecture: ClassVar[str] = "Qwen3_5MoeForConditionalGeneration"
