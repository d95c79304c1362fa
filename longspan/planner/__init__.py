"""``longspan plan``: memory and step time per parallel layout, and the search over layouts (``plan``).

May import: core, config, models, data, parallel (the measured CPU peak of
``longspan.training.observability.mfu`` only inside a function, to keep the planner light).
"""
