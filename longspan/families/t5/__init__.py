"""T5 and mT5 (``T5ForConditionalGeneration``, ``MT5ForConditionalGeneration``) as HF architectures of the T5
model kind (``longspan.models.t5``)."""

from __future__ import annotations

from longspan.conversion.families import register_family
from longspan.families.t5.hf import MT5_FAMILY, T5_FAMILY

register_family(T5_FAMILY)
register_family(MT5_FAMILY)
