"""The config dataclasses, Megatron Bridge's names and defaults with a docstring per field:
``ConfigContainer`` (``container``), data and tokenizer (``data``), optimizer, DDP and scheduler (``optim``),
training loop, checkpoint and logger (``training``), RNG, distributed init, profiling and resilience (``infra``).
Construction never validates; ``ConfigContainer.validate()`` runs the rules in ``longspan.config.rules``.

May import: core and the rest of config.
"""
