"""Gemma 4: its text model (``Gemma4ForCausalLM``) and its vision-language model (``Gemma4ForConditionalGeneration``
with images; without a vision encoder its text tower imports alone).

``provider`` (``Gemma4ModelProvider``), ``model`` (its layers on the GPT blocks), ``vl_provider``
(``Gemma4VLModelProvider``), ``vision`` (the vision encoder and projector), ``vl_model`` (the model with images),
``hf`` (config.json and weights of both), ``moe`` (the MoE block beside the dense MLP), ``recipes`` (``gemma4``: LoRA finetune of E4B;
``gemma4-moe-lora``: of 26B-A4B).
"""

from __future__ import annotations

from longspan.config.support import register_model_support
from longspan.config.targets import register_config_class
from longspan.conversion.families import register_family
from longspan.families.gemma4 import recipes
from longspan.families.gemma4.hf import GEMMA4, GEMMA4_VLM_FAMILY
from longspan.families.gemma4.provider import Gemma4ModelProvider
from longspan.families.gemma4.vl_provider import Gemma4VLModelProvider
from longspan.recipes import register_recipe

register_config_class(Gemma4ModelProvider, "model", "longspan.models", foreign_names=(
    "megatron.bridge.models.gemma.gemma4_provider.Gemma4ModelProvider",
    "megatron.bridge.models.Gemma4ModelProvider"), bridge_provider_pattern="Gemma4")

# Its own fields, proven by tests/conversion/test_gemma4.py (logits against transformers with every field set,
# KV sharing in generation, the one-line errors).
register_model_support(
    "Gemma4ModelProvider",
    supported="""global_kv_channels num_global_query_groups global_rotary_percent attention_k_eq_v
        num_kv_shared_layers use_double_wide_mlp per_layer_embed_dim per_layer_embed_vocab_size""",
    not_supported="",
    reasons={},
)
register_family(GEMMA4)

register_config_class(Gemma4VLModelProvider, "model", "longspan.models", bridge_provider_pattern="Gemma4VL")
# Its own fields beside the text model's, proven by tests/conversion/test_gemma4_vlm.py (logits with two images of
# different sizes against transformers for vision_config, image_token_id and pad_token_id; the freeze_* fields by
# test_provider_freezes_parts_and_checks_its_vision_fields). The delimiters' and bos/eos ids are recorded for the
# export. With use_bidirectional_attention='vision', PP2 (the image tokens handed on in the stage carry), TP2 + SP
# and CP2 equal one process (tests/data/sft_vlm/test_gemma4_vlm_layouts.py).
register_model_support(
    "Gemma4VLModelProvider",
    supported="""global_kv_channels num_global_query_groups global_rotary_percent attention_k_eq_v
        num_kv_shared_layers use_double_wide_mlp per_layer_embed_dim per_layer_embed_vocab_size vision_config
        bos_token_id eos_token_id pad_token_id vision_start_token_id vision_end_token_id image_token_id
        use_bidirectional_attention
        freeze_language_model freeze_vision_model freeze_vision_projection""",
    not_supported="",
    reasons={},
)
register_family(GEMMA4_VLM_FAMILY)
register_recipe("gemma4", recipes.gemma4, family="gemma4")
register_recipe("gemma4-moe-lora", recipes.gemma4_moe_lora, family="gemma4")
