"""Gemma 4's vision-language model (``Gemma4ForConditionalGeneration`` with images): Gemma 4's vision encoder and
projector feeding Gemma 4's text model (``longspan.families.gemma4``).

``provider`` (``Gemma4VLModelProvider``), ``vision`` (the encoder and projector), ``model`` (the model), ``hf``
(config.json and weights; a config.json without ``vision_config`` imports as the text tower).
"""

from __future__ import annotations

from longspan.config.support import register_model_support
from longspan.config.targets import register_config_class
from longspan.conversion.families import register_family
from longspan.families.gemma4_vl.hf import GEMMA4_VLM_FAMILY
from longspan.families.gemma4_vl.provider import Gemma4VLModelProvider

register_config_class(Gemma4VLModelProvider, "model", "longspan.models", bridge_provider_pattern="Gemma4VL")

# Its own fields, proven by tests/conversion/test_gemma4_vlm.py (logits with two images of different sizes
# against transformers for vision_config, image_token_id and pad_token_id; the freeze_* fields by
# test_provider_freezes_parts_and_checks_its_vision_fields). The token ids of the delimiters and bos/eos are
# recorded for the export.
register_model_support(
    "Gemma4VLModelProvider",
    supported="""vision_config bos_token_id eos_token_id pad_token_id vision_start_token_id vision_end_token_id
        image_token_id freeze_language_model freeze_vision_model freeze_vision_projection""",
    not_supported="",
    reasons={},
)
register_family(GEMMA4_VLM_FAMILY)
