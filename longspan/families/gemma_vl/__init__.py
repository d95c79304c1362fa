"""Gemma 3's vision-language model (``Gemma3ForConditionalGeneration``): a SigLIP encoder and a pooled projector
feeding a Gemma 3 language model.

``provider`` (``Gemma3VLModelProvider``, public as ``longspan.models.Gemma3VLModelProvider``), ``model`` (the
model and its two-way image-block mask), ``siglip`` (the SigLIP encoder), ``hf`` (config.json and weights; the
language model's translation and table are Gemma 3 text's).
"""

from __future__ import annotations

from longspan.config.support import register_model_support
from longspan.config.targets import register_config_class
from longspan.conversion.families import register_family
from longspan.families.gemma_vl.hf import GEMMA3_VLM_FAMILY
from longspan.families.gemma_vl.provider import Gemma3VLModelProvider
from longspan.models.vlm.provider import NO_MTP_REASON

register_config_class(Gemma3VLModelProvider, "model", "longspan.models", foreign_names=(
    "megatron.bridge.models.gemma_vl.gemma3_vl_provider.Gemma3VLModelProvider",
    "megatron.bridge.models.gemma_vl.Gemma3VLModelProvider", "megatron.bridge.models.Gemma3VLModelProvider"),
    bridge_provider_pattern="Gemma3VL")

# Its own fields, proven by tests/conversion/test_gemma_vlm.py (logits with images against transformers for
# vision_config, mm_tokens_per_image and image_token_id; test_provider_freezes_parts_and_checks_its_image_fields for
# freeze_*). The token ids of the delimiters and bos/eos are recorded for the export. Tensor parallel splits the
# language model and replicates the encoder; pipeline parallel keeps the encoder on the first stage, also with
# virtual stages and the pipeline split fields (its pp2-vp2 case; tests/parallel/test_pipeline.py); sequence and
# context parallel split the sequence after the image merge (tests/data/sft_vlm/test_gemma_vlm_finetune.py: FSDP2,
# TP2, TP2 + SP, PP2, PP2 x VP2 and CP2 equal one process; with 4 experts in the language model EP2 equals one
# process: test_gemma_moe_vlm_under_expert_parallel_logs_the_losses_of_one_process).
register_model_support(
    "Gemma3VLModelProvider",
    supported="""vision_config mm_tokens_per_image bos_token_id eos_token_id vision_start_token_id
        vision_end_token_id image_token_id freeze_language_model freeze_vision_model freeze_vision_projection""",
    not_supported="mtp_num_layers mtp_loss_scaling_factor mtp_enabled",
    reasons={"mtp_num_layers": NO_MTP_REASON, "mtp_loss_scaling_factor": NO_MTP_REASON, "mtp_enabled": NO_MTP_REASON},
)
register_family(GEMMA3_VLM_FAMILY)
