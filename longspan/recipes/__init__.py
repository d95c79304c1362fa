"""Recipes: functions that return a complete ``ConfigContainer``; ``--recipe NAME`` picks one.

May import: everything below it (core through training).
"""

from __future__ import annotations

import difflib
from typing import Callable

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
from longspan.training.config import ConfigContainer

RECIPES: dict[str, Callable[[], ConfigContainer]] = {
    "tiny": tiny,
    "tiny_moe": tiny_moe,
    "tiny_deepseek": tiny_deepseek,
    "tiny_mamba": tiny_mamba,
    "tiny_hybrid": tiny_hybrid,
    "tiny_t5": tiny_t5,
    "llama3_8b": llama3_8b,
    "llama3_70b": llama3_70b,
    "qwen3_8b": qwen3_8b,
    "qwen3_600m": qwen3_600m,
    "gemma3": gemma3,
    "llama32": llama32,
    "llama32_3b": llama32_3b,
    "sft": sft,
    "lora": lora,
    "dora": dora,
    "moe_lora": moe_lora,
}


def list_recipes() -> list[str]:
    """Names accepted by ``get_recipe`` (hyphens and underscores are interchangeable)."""
    return sorted(RECIPES)


def get_recipe(name: str) -> ConfigContainer:
    """A fresh ConfigContainer of the named recipe; unknown names raise ConfigError listing the known ones."""
    key = name.strip().replace("-", "_").lower()
    if key not in RECIPES:
        close = difflib.get_close_matches(key, RECIPES, n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        raise ConfigError(f"unknown recipe {name!r}: {hint}choose one of {', '.join(list_recipes())}")
    return RECIPES[key]()


__all__ = ["RECIPES", "get_recipe", "list_recipes", "tiny", "tiny_moe", "tiny_deepseek", "tiny_mamba", "tiny_hybrid", "tiny_t5", "llama3_8b", "llama3_70b", "qwen3_8b", "qwen3_600m", "gemma3", "llama32",
           "llama32_3b", "sft", "lora", "dora", "moe_lora"]
