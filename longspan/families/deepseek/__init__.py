"""DeepSeek-V3 (``DeepseekV3ForCausalLM``) and the ``tiny-deepseek`` recipe."""

from __future__ import annotations

from longspan.conversion.families import register_family
from longspan.families.deepseek import recipes
from longspan.families.deepseek.hf import DEEPSEEK_V3
from longspan.recipes import register_recipe

register_family(DEEPSEEK_V3)
register_recipe("tiny-deepseek", recipes.tiny_deepseek, family="deepseek_v3")
