"""Llama: Llama 2/3/3.1/3.2 (``LlamaForCausalLM``) and its recipes."""

from __future__ import annotations

from longspan.conversion.families import register_family
from longspan.families.llama import recipes
from longspan.families.llama.hf import LLAMA
from longspan.recipes import register_recipe

register_family(LLAMA)
register_recipe("llama3-8b", recipes.llama3_8b, family="llama")
register_recipe("llama3-70b", recipes.llama3_70b, family="llama")
register_recipe("llama32", recipes.llama32, family="llama")
register_recipe("llama32-3b", recipes.llama32_3b, family="llama")
