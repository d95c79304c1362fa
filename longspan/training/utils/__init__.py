"""Training utilities under Bridge's ``training.utils`` path: ``train_utils`` (value heads, MoE router
freezing, norms and reductions across parallel groups, GlobalState injection into forward steps), ``comm``
and ``norms``.

May import: everything below training, and training's state and observability.
"""
