"""Gemma 4's text model (``Gemma4ForCausalLM``; ``longspan.families.gemma4_vl`` registers
``Gemma4ForConditionalGeneration``, whose text tower alone imports through ``hf.GEMMA4_VL_TEXT``).

``provider`` (``Gemma4ModelProvider``), ``model`` (its layers on the GPT blocks), ``hf`` (config.json and
weights), ``moe`` (the MoE block beside the dense MLP), ``recipes`` (``gemma4``: LoRA finetune of E4B;
``gemma4-moe-lora``: of 26B-A4B).
"""

from __future__ import annotations

from longspan.config.support import register_model_support
from longspan.config.targets import register_config_class
from longspan.conversion.families import register_family
from longspan.families.gemma4 import recipes
from longspan.families.gemma4.hf import GEMMA4
from longspan.families.gemma4.provider import Gemma4ModelProvider
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
register_recipe("gemma4", recipes.gemma4, family="gemma4")
register_recipe("gemma4-moe-lora", recipes.gemma4_moe_lora, family="gemma4")
