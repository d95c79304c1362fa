"""OLMo-2 (``Olmo2ForCausalLM``)."""

from __future__ import annotations

from longspan.conversion.families import register_family
from longspan.families.olmo.hf import OLMO2

register_family(OLMO2)
