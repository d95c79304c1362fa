"""Nemotron-H and Nemotron 3 (``NemotronHForCausalLM``) as an HF architecture of the hybrid Mamba model kind
(``longspan.models.mamba``), and the ``nemotron3-nano`` and ``nemotron3-nano-lora`` recipes."""

from __future__ import annotations

from longspan.conversion.families import register_family
from longspan.families.nemotron import recipes
from longspan.families.nemotron.hf import NEMOTRON_H
from longspan.recipes import register_recipe

register_family(NEMOTRON_H)
register_recipe("nemotron3-nano", recipes.nemotron3_nano, family="nemotron_h")
register_recipe("nemotron3-nano-lora", recipes.nemotron3_nano_lora, family="nemotron_h")
