"""MiniMax-M2 (``MiniMaxM2ForCausalLM``: M2, M2.5, M2.7): a mixture-of-experts decoder with QK-norm across heads,
partial RoPE and sigmoid routing with the expert bias; its recipe."""

from __future__ import annotations

from longspan.conversion.families import register_family
from longspan.families.minimax import recipes
from longspan.families.minimax.hf import MINIMAX_M2
from longspan.recipes import register_recipe

register_family(MINIMAX_M2)
register_recipe("minimax-m2", recipes.minimax_m2, family="minimax_m2")
