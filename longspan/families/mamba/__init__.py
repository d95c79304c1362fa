"""Mamba-2 (``Mamba2ForCausalLM``) as an HF architecture of the Mamba model kind (``longspan.models.mamba``)."""

from __future__ import annotations

from longspan.conversion.families import register_family
from longspan.families.mamba.hf import MAMBA2

register_family(MAMBA2)
