"""Qwen2, Qwen3 and Qwen3-MoE (``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``, ``Qwen3MoeForCausalLM``) and the
Qwen3 recipes."""

from __future__ import annotations

from longspan.conversion.families import register_family
from longspan.families.qwen import recipes
from longspan.families.qwen.hf import QWEN2, QWEN3, QWEN3_MOE
from longspan.recipes import register_recipe

register_family(QWEN2)
register_family(QWEN3)
register_family(QWEN3_MOE)
register_recipe("qwen3-8b", recipes.qwen3_8b, family="qwen3")
register_recipe("qwen3-600m", recipes.qwen3_600m, family="qwen3")
