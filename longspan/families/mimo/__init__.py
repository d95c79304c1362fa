"""MiMo-V2-Flash (``MiMoV2FlashForCausalLM``): sliding-window layers with their own KV heads and attention sinks,
narrow scaled values, RoPE per layer kind, sigmoid-routed MoE.

``provider`` (``MiMoV2FlashModelProvider``), ``model`` (its layers on the GPT blocks), ``hf`` (config.json and
weights).
"""

from __future__ import annotations

from longspan.config.support import register_model_support
from longspan.config.targets import register_config_class
from longspan.conversion.families import register_family
from longspan.families.mimo.hf import MIMO_V2_FLASH
from longspan.families.mimo.provider import MiMoV2FlashModelProvider

register_config_class(MiMoV2FlashModelProvider, "model", "longspan.models")

# Its own fields, proven by tests/conversion/test_mimo.py (logits against transformers with every field set, the
# KV cache of narrow values in generation, the one-line errors).
register_model_support(
    "MiMoV2FlashModelProvider",
    supported="v_head_dim window_num_query_groups window_softmax_type attention_value_scale",
    not_supported="",
    reasons={},
)
register_family(MIMO_V2_FLASH)
