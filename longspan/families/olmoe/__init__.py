"""OLMoE (``OlmoeForCausalLM``): a mixture-of-experts decoder with QK-norm across heads."""

from __future__ import annotations

from longspan.conversion.families import register_family
from longspan.families.olmoe.hf import OLMOE_FAMILY

register_family(OLMOE_FAMILY)
