"""GLM-4.5 / 4.6 (``Glm4MoeForCausalLM``) and GLM-4.7-Flash (``Glm4MoeLiteForCausalLM``)."""

from __future__ import annotations

from longspan.conversion.families import register_family
from longspan.families.glm.hf import GLM4_MOE, GLM4_MOE_LITE

register_family(GLM4_MOE)
register_family(GLM4_MOE_LITE)
