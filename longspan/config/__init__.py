"""The whole config story: schema dataclasses (``schema/``), the validation rules (``rules/``), YAML and
dotlist I/O (``serialize``, ``overrides``), the ``_target_`` allowlist (``targets``), and the field support
table with its doc generator (``support``, ``support_doc``).

The entry point for commands is ``load_config(recipe, config_files, overrides, allow_unknown=False)``.

May import: core. The schema also names the providers and PEFT configs a ``ConfigContainer`` holds
(``longspan.models.*_provider``, ``longspan.peft.config``); anything higher only inside a function, with a
comment saying why.
"""

from longspan.config.overrides import apply_overrides, load_config, parse_dotlist
from longspan.config.serialize import container_from_dict, dump_yaml, load_yaml_file, to_dict
from longspan.config.support import check_supported, field_status, inapplicable_fields, unsupported_settings

__all__ = [
    "load_config", "apply_overrides", "parse_dotlist", "container_from_dict", "dump_yaml", "load_yaml_file",
    "to_dict", "check_supported", "field_status", "inapplicable_fields", "unsupported_settings",
]
