"""Every validation rule of a ``ConfigContainer``, one ordered list of named rules (``validate``):
value ranges, precision, parallel layout, LR/WD schedule, data, infrastructure and resilience checks. A rule
names the field, the value and what is valid (``ConfigError`` / ``NotSupportedError``).

May import: core and the rest of config.
"""
