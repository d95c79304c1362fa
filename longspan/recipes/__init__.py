"""Recipes: functions that return a complete ``ConfigContainer``; ``--recipe NAME`` picks one.

Recipe names are spelled with hyphens (``tiny-moe``) wherever they are shown; underscores are accepted too.

May import: everything below it (core through training).
"""

from __future__ import annotations

import difflib
from typing import Callable

from longspan.config.explicit import mark_model_family, mark_recipe_fields
from longspan.core.errors import ConfigError
from longspan.core.plugins import load_plugins
from longspan.recipes.distill import distill_student
from longspan.recipes.finetune import dora, lora, sft
from longspan.recipes.moe_finetune import moe_lora
from longspan.recipes.tiny import tiny
from longspan.recipes.tiny_mamba import tiny_hybrid, tiny_mamba
from longspan.recipes.tiny_moe import tiny_moe
from longspan.recipes.tiny_t5 import tiny_t5
from longspan.training.config import ConfigContainer

# name as shown everywhere (hyphens) -> recipe function
RECIPES: dict[str, Callable[[], ConfigContainer]] = {
    "tiny": tiny,
    "tiny-moe": tiny_moe,
    "tiny-mamba": tiny_mamba,
    "tiny-hybrid": tiny_hybrid,
    "tiny-t5": tiny_t5,
    "sft": sft,
    "lora": lora,
    "dora": dora,
    "moe-lora": moe_lora,
    "distill": distill_student,
}


RECIPE_FAMILY: dict[str, str] = {}
"""Recipe name -> the ``conversion.families.Family.name`` its model is built as (the family packages' recipes)."""


def register_recipe(name: str, recipe: Callable[[], ConfigContainer], family: str | None = None) -> None:
    """Add a recipe (called by a family package); ``family`` names the HF family its model is built as."""
    key = canonical_recipe_name(name)
    if key in RECIPES:
        raise ValueError(f"recipe {key!r} is registered twice")
    RECIPES[key] = recipe
    if family is not None:
        RECIPE_FAMILY[key] = family


def list_recipes() -> list[str]:
    """The recipe names as shown everywhere (hyphenated); ``get_recipe`` also accepts them with underscores."""
    load_plugins()
    return list(RECIPES)


def canonical_recipe_name(name: str) -> str:
    """The shown spelling of a recipe name: lower case, hyphens for underscores (``tiny_moe`` -> ``tiny-moe``)."""
    return name.strip().replace("_", "-").lower()


def get_recipe(name: str) -> ConfigContainer:
    """A fresh ConfigContainer of the named recipe; unknown names raise ConfigError listing the known ones."""
    key = canonical_recipe_name(name)
    load_plugins()
    if key not in RECIPES:
        close = difflib.get_close_matches(key, RECIPES, n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        raise ConfigError(f"unknown recipe {name!r}: {hint}choose one of {', '.join(list_recipes())}")
    cfg = RECIPES[key]()
    mark_recipe_fields(cfg, key)  # the recipe's own settings count as set on purpose
    if key in RECIPE_FAMILY:
        mark_model_family(cfg, RECIPE_FAMILY[key])
    return cfg


__all__ = ["RECIPES", "canonical_recipe_name", "get_recipe", "list_recipes", "register_recipe", "tiny", "tiny_moe",
           "tiny_mamba", "tiny_hybrid", "tiny_t5", "sft", "lora", "dora", "moe_lora"]
