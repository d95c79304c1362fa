"""GPT-2 (``GPT2LMHeadModel``)."""

from __future__ import annotations

from longspan.conversion.families import register_family
from longspan.families.gpt2.hf import GPT2

register_family(GPT2)
