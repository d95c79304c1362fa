"""The configuration of a run: the schema dataclasses (``schema/``), every validation rule in order
(``rules/``), YAML I/O with the allowlisted ``_target_`` names, dotlist overrides, and the field-support table
with its doc generator. It imports only ``longspan.core``; the model providers and PEFT configs it refers to
are named by dotted path (``targets.py``). A run's config is loaded from a recipe plus files plus overrides by
``longspan.recipes.loading.load_config``.
"""

from longspan.config.overrides import apply_overrides, parse_dotlist
from longspan.config.serialize import container_from_dict, dump_yaml, load_yaml_file, to_dict
from longspan.config.support import check_supported, field_status, inapplicable_fields, unsupported_settings

__all__ = [
    "apply_overrides", "parse_dotlist", "container_from_dict", "dump_yaml", "load_yaml_file",
    "to_dict", "check_supported", "field_status", "inapplicable_fields", "unsupported_settings",
]
