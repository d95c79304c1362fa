"""Gemma 3's vision-language model (``Gemma3ForConditionalGeneration``): its config.json translation and weight
table (``hf``; the language model's translation and table are Gemma 3 text's)."""

from __future__ import annotations

from longspan.conversion.families import register_family
from longspan.families.gemma_vl.hf import GEMMA3_VLM_FAMILY

register_family(GEMMA3_VLM_FAMILY)
