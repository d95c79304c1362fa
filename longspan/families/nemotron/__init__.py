"""Nemotron-H (``NemotronHForCausalLM``) as an HF architecture of the hybrid Mamba model kind
(``longspan.models.mamba``)."""

from __future__ import annotations

from longspan.conversion.families import register_family
from longspan.families.nemotron.hf import NEMOTRON_H

register_family(NEMOTRON_H)
