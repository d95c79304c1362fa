"""``longspan plan``: memory and step time per parallel layout, and the search over layouts (``plan``).

May import: core, config, models, data, parallel, peft, conversion. (One known exception, inside a function:
the measured CPU peak comes from ``longspan.training.observability.mfu``; it is to move below the planner.)
"""
