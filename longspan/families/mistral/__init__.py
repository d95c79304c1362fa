"""Mistral and Ministral (``MistralForCausalLM``, ``MinistralForCausalLM``): the standard decoder with sliding
windows."""

from __future__ import annotations

from longspan.conversion.families import register_family
from longspan.families.mistral.hf import MINISTRAL, MISTRAL

register_family(MISTRAL)
register_family(MINISTRAL)
