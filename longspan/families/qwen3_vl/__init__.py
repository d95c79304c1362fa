"""Qwen3-VL (``Qwen3VLForConditionalGeneration``, ``Qwen3VLMoeForConditionalGeneration``): a Qwen3 (or Qwen3-MoE)
language model with interleaved multimodal RoPE, fed by a ViT with learned position embeddings through a patch
merger, plus DeepStack features of chosen encoder blocks added after the first decoder layers; images and videos.
Qwen3.5 with images (``Qwen3_5ForConditionalGeneration``, ``Qwen3_5MoeForConditionalGeneration``): the same
encoder without DeepStack on Qwen3.5's gated DeltaNet hybrid (``longspan.families.qwen35``'s translation).

``provider`` (``Qwen3VLModelProvider``, ``Qwen3VLMoEModelProvider``, ``Qwen35VLModelProvider``,
``Qwen35VLMoEModelProvider``, public in ``longspan.models``), ``model`` (the model and its DeepStack hooks),
``vision`` (the encoder and mergers), ``positions`` (interleaved mRoPE and the position ids of images and video
frames), ``hf`` (config.json and weights). The ``vlm-sft`` / ``vlm-lora``
recipes (``longspan.families.qwen_vl.recipes``) take the model of a pretrained Qwen3-VL directory.
"""

from __future__ import annotations

from longspan.config.support import register_model_support
from longspan.config.targets import register_config_class
from longspan.conversion.families import register_family
from longspan.data.sft.video import register_video_preprocessor
from longspan.families.qwen3_vl.hf import QWEN3_VL_FAMILY, QWEN3_VL_MOE_FAMILY, QWEN35_VL_FAMILY, QWEN35_VL_MOE_FAMILY
from longspan.families.qwen3_vl.provider import (Qwen35VLModelProvider, Qwen35VLMoEModelProvider, Qwen3VLModelProvider,
                                                Qwen3VLMoEModelProvider)
from longspan.families.qwen3_vl.video import Qwen3VLVideoPreprocessor
from longspan.models.vlm.provider import NO_MTP_REASON

register_config_class(Qwen3VLModelProvider, "model", "longspan.models", foreign_names=(
    "megatron.bridge.models.qwen_3_vl.provider.Qwen3VLModelProvider",
    "megatron.bridge.models.qwen_3_vl.Qwen3VLModelProvider", "megatron.bridge.models.Qwen3VLModelProvider"),
    bridge_provider_pattern="^Qwen3VLModelProvider")
register_config_class(Qwen3VLMoEModelProvider, "model", "longspan.models", foreign_names=(
    "megatron.bridge.models.qwen_3_vl.moe_provider.Qwen3VLMoEModelProvider",
    "megatron.bridge.models.qwen_3_vl.Qwen3VLMoEModelProvider", "megatron.bridge.models.Qwen3VLMoEModelProvider"),
    bridge_provider_pattern="^Qwen3VLMoE")
register_config_class(Qwen35VLModelProvider, "model", "longspan.models")
register_config_class(Qwen35VLMoEModelProvider, "model", "longspan.models")

# Their own fields, each shown to act by tests/models/vlm/test_qwen3_vl.py: vision_config (logits with two images
# and with a video equal transformers'; DeepStack's features dropped or moved change them), mrope_section (the
# interleaved table), image/video token ids (the same logits), the freeze options and the refused layouts
# (test_freeze_options_stop_their_parts_and_unserved_layouts_are_refused). FSDP2, tensor parallel (encoder and
# mergers replicated), with sequence parallel, context parallel (the DeepStack features travel beside the
# embeddings and are cut with them) and pipeline parallel (encoder, mergers and the DeepStack layers on the first
# stage) equal one process on mixed image and text-only data (tests/data/sft_vlm/test_qwen3_vl_finetune.py); the
# MoE model's expert parallel (EP2) too (tests/data/sft_vlm/test_vlm_moe_layouts.py).
# Whole-layer recompute and a pipeline split that moves a DeepStack layer off the first stage are refused in one
# line when the model is built.
for _name in ("Qwen3VLModelProvider", "Qwen3VLMoEModelProvider", "Qwen35VLModelProvider", "Qwen35VLMoEModelProvider"):
    register_model_support(
        _name,
        supported="""mrope_section vision_config image_token_id bos_token_id eos_token_id vision_start_token_id
            vision_end_token_id vision_token_id video_token_id freeze_language_model freeze_vision_model
            freeze_vision_projection""",
        not_supported="mtp_num_layers mtp_loss_scaling_factor multi_latent_attention",
        reasons={
            "mtp_num_layers": NO_MTP_REASON,
            "mtp_loss_scaling_factor": NO_MTP_REASON,
            "multi_latent_attention": ("Qwen3-VL's mRoPE table rotates all kv_channels; multi-latent attention's "
                                       "separate rotary part has no mRoPE numbering"),
        },
    )
register_family(QWEN3_VL_FAMILY)
register_family(QWEN3_VL_MOE_FAMILY)
register_family(QWEN35_VL_FAMILY)
register_family(QWEN35_VL_MOE_FAMILY)
# Qwen3-VL's and Qwen3.5's HF processor (transformers maps both to Qwen3VLProcessor) gets longspan's video
# preprocessing in place of transformers' torchvision-bound one
register_video_preprocessor("Qwen3VLProcessor", Qwen3VLVideoPreprocessor.from_directory)
