"""``longspan plan``: memory and step time per parallel layout, and the search over layouts (``plan``).

May import: core, config, models, data, parallel, peft, conversion.
"""
