"""Qwen3-Next (``Qwen3NextForCausalLM``): the gated DeltaNet / gated attention hybrid with shared-expert MoE,
and its pretraining recipe."""

from __future__ import annotations

from longspan.conversion.families import register_family
from longspan.families.qwen3_next import recipes
from longspan.families.qwen3_next.hf import QWEN3_NEXT
from longspan.recipes import register_recipe

register_family(QWEN3_NEXT)
register_recipe("qwen3-next", recipes.qwen3_next_80b_a3b, family="qwen3_next")
