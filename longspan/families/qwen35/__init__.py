"""Qwen3.5 / Qwen3.6 (``Qwen3_5ForCausalLM``, ``Qwen3_5MoeForCausalLM``) and their recipes; their
vision-language models import whole in ``longspan.families.qwen3_vl``."""

from __future__ import annotations

from longspan.conversion.families import register_family
from longspan.families.qwen35 import recipes
from longspan.families.qwen35.hf import QWEN35, QWEN35_MOE
from longspan.recipes import register_recipe

register_family(QWEN35)
register_family(QWEN35_MOE)
register_recipe("qwen35", recipes.qwen35, family="qwen35")
register_recipe("qwen36-moe-lora", recipes.qwen36_moe_lora, family="qwen35_moe")
