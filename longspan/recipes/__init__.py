"""Recipes: functions that return a complete ``ConfigContainer``; ``--recipe NAME`` picks one.

Recipe names are spelled with hyphens (``tiny-moe``) wherever they are shown; underscores are accepted too.

May import: everything below it (core through training).
"""

from __future__ import annotations

import difflib
from typing import Callable

from longspan.config.explicit import mark_recipe_fields
from longspan.core.errors import ConfigError
from longspan.recipes.finetune import dora, lora, sft
from longspan.recipes.llama import llama3_8b, llama3_70b, qwen3_8b, qwen3_600m
from longspan.recipes.moe_finetune import moe_lora
from longspan.recipes.small_models import gemma3, llama32, llama32_3b
from longspan.recipes.tiny import tiny
from longspan.recipes.tiny_deepseek import tiny_deepseek
from longspan.recipes.tiny_mamba import tiny_hybrid, tiny_mamba
from longspan.recipes.tiny_moe import tiny_moe
from longspan.recipes.tiny_t5 import tiny_t5
from longspan.recipes.vlm_finetune import vlm_lora, vlm_sft
from longspan.training.config import ConfigContainer

# name as shown everywhere (hyphens) -> recipe function
RECIPES: dict[str, Callable[[], ConfigContainer]] = {
    "tiny": tiny,
    "tiny-moe": tiny_moe,
    "tiny-deepseek": tiny_deepseek,
    "tiny-mamba": tiny_mamba,
    "tiny-hybrid": tiny_hybrid,
    "tiny-t5": tiny_t5,
    "llama3-8b": llama3_8b,
    "llama3-70b": llama3_70b,
    "qwen3-8b": qwen3_8b,
    "qwen3-600m": qwen3_600m,
    "gemma3": gemma3,
    "llama32": llama32,
    "llama32-3b": llama32_3b,
    "sft": sft,
    "lora": lora,
    "dora": dora,
    "moe-lora": moe_lora,
    "vlm-sft": vlm_sft,
    "vlm-lora": vlm_lora,
}


def list_recipes() -> list[str]:
    """The recipe names as shown everywhere (hyphenated); ``get_recipe`` also accepts them with underscores."""
    return list(RECIPES)


def canonical_recipe_name(name: str) -> str:
    """The shown spelling of a recipe name: lower case, hyphens for underscores (``tiny_moe`` -> ``tiny-moe``)."""
    return name.strip().replace("_", "-").lower()


def get_recipe(name: str) -> ConfigContainer:
    """A fresh ConfigContainer of the named recipe; unknown names raise ConfigError listing the known ones."""
    key = canonical_recipe_name(name)
    if key not in RECIPES:
        close = difflib.get_close_matches(key, RECIPES, n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        raise ConfigError(f"unknown recipe {name!r}: {hint}choose one of {', '.join(list_recipes())}")
    cfg = RECIPES[key]()
    mark_recipe_fields(cfg, key)  # the recipe's own settings count as set on purpose
    return cfg


__all__ = ["RECIPES", "canonical_recipe_name", "get_recipe", "list_recipes", "tiny", "tiny_moe", "tiny_deepseek", "tiny_mamba", "tiny_hybrid", "tiny_t5", "llama3_8b", "llama3_70b", "qwen3_8b", "qwen3_600m", "gemma3", "llama32",
           "llama32_3b", "sft", "lora", "dora", "moe_lora", "vlm_sft", "vlm_lora"]
