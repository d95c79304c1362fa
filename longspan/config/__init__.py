"""Configuration I/O: YAML (safe, allowlisted ``_target_``), overrides, field support.

The entry point for commands is ``load_config(recipe, config_files, overrides, allow_unknown=False)``.
"""

from longspan.config.overrides import apply_overrides, load_config, parse_dotlist
from longspan.config.serialize import container_from_dict, dump_yaml, load_yaml_file, to_dict
from longspan.config.support import check_supported, field_status, inapplicable_fields, unsupported_settings

__all__ = [
    "load_config", "apply_overrides", "parse_dotlist", "container_from_dict", "dump_yaml", "load_yaml_file",
    "to_dict", "check_supported", "field_status", "inapplicable_fields", "unsupported_settings",
]
