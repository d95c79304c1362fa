"""Mixtral (``MixtralForCausalLM``): Mistral's decoder with mixture-of-experts MLPs."""

from __future__ import annotations

from longspan.conversion.families import register_family
from longspan.families.mixtral.hf import MIXTRAL

register_family(MIXTRAL)
