"""Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``): a Qwen2 language model with multimodal RoPE fed by a ViT
through a patch merger.

``provider`` (``Qwen25VLModelProvider``, public as ``longspan.models.Qwen25VLModelProvider``), ``model`` (the
model: vision tower, merger, language model), ``vision`` (the ViT and the merger), ``hf`` (config.json and
weights), ``recipes`` (``vlm-sft``, ``vlm-lora``: the model of a pretrained HF directory of any vision-language
family). Multimodal RoPE itself is a shared block (``longspan.models.vlm.mrope``).
"""

from __future__ import annotations

from longspan.config.support import register_model_support
from longspan.config.targets import register_config_class
from longspan.conversion.families import register_family
from longspan.families.qwen_vl import recipes
from longspan.families.qwen_vl.hf import QWEN25_VL_FAMILY
from longspan.families.qwen_vl.provider import Qwen25VLModelProvider
from longspan.models.vlm.provider import NO_MTP_REASON
from longspan.recipes import register_recipe

register_config_class(Qwen25VLModelProvider, "model", "longspan.models", foreign_names=(
    "megatron.bridge.models.qwen_vl.qwen25_vl_provider.Qwen25VLModelProvider",
    "megatron.bridge.models.qwen_vl.Qwen25VLModelProvider", "megatron.bridge.models.Qwen25VLModelProvider"),
    bridge_provider_pattern="^Qwen25VL")

# Its own fields, each shown to act by tests/models/vlm/test_qwen25_vl.py (test_the_vlm_fields_change_the_model;
# the token ids other than image_token_id are written to the exported config.json:
# test_a_provider_made_export_reads_back_in_transformers). Tensor parallel splits the language model and replicates
# the vision encoder; pipeline parallel keeps the encoder on the first stage (tests/data/sft_vlm/test_vlm_finetune.py:
# FSDP2, TP2 and PP2 equal one process). The pipeline split fields (virtual_pipeline_model_parallel_size,
# num_layers_in_first/last_pipeline_stage, account_for_embedding/loss_in_pipeline_split) split the language model's
# layers as GPT's do, the encoder on virtual stage 0 with the embedding (test_vlm_finetune.py's pp2-uneven and pp2-vp2
# cases equal one process; tests/parallel/test_pipeline.py::test_vision_language_stages_split_the_language_layers_
# and_keep_the_encoder_with_the_embedding counts the layers and parameters of each stage). Sequence and context
# parallel cut the sequence after the image merge (tests/data/sft_vlm/test_vlm_finetune.py and
# test_gemma_vlm_finetune.py: TP2 + SP and CP2 equal one process). Expert parallel on a language model with experts:
# tests/data/sft_vlm/test_vlm_finetune.py::test_moe_vlm_under_expert_parallel_logs_the_losses_of_one_process (EP2
# equals one process; without experts EP>1 is GPT's ConfigError). Multi-latent attention has no mRoPE table
# (config.rules.model.check_mrope_model).
register_model_support(
    "Qwen25VLModelProvider",
    supported="""mrope_section vision_config image_token_id bos_token_id eos_token_id vision_start_token_id
        vision_end_token_id vision_token_id video_token_id freeze_language_model freeze_vision_model
        freeze_vision_projection""",
    not_supported="mtp_num_layers mtp_loss_scaling_factor multi_latent_attention",
    reasons={
        "mtp_num_layers": NO_MTP_REASON,
        "mtp_loss_scaling_factor": NO_MTP_REASON,
        "multi_latent_attention": ("Qwen2.5-VL's mRoPE table rotates all kv_channels; multi-latent attention's "
                                   "separate rotary part has no mRoPE numbering"),
    },
)
register_family(QWEN25_VL_FAMILY)
# The recipes' model is a placeholder that the pretrained directory's family replaces (no family recorded).
register_recipe("vlm-sft", recipes.vlm_sft)
register_recipe("vlm-lora", recipes.vlm_lora)
