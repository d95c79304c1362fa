"""Gemma 2 and Gemma 3's text model (``Gemma2ForCausalLM``, ``Gemma3ForCausalLM``) and the Gemma 3 1B finetune
recipe."""

from __future__ import annotations

from longspan.conversion.families import register_family
from longspan.families.gemma import recipes
from longspan.families.gemma.hf import GEMMA2, GEMMA3
from longspan.recipes import register_recipe

register_family(GEMMA2)
register_family(GEMMA3)
register_recipe("gemma3", recipes.gemma3, family="gemma3")
