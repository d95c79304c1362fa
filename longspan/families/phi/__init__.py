"""Phi-3 / Phi-4 (``Phi3ForCausalLM``)."""

from __future__ import annotations

from longspan.conversion.families import register_family
from longspan.families.phi.hf import PHI3

register_family(PHI3)
