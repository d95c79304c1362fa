"""The training loop and its entry points, with Megatron Bridge's module names: ``pretrain``, ``finetune``,
``setup``, ``train``, ``eval``, ``state``; ``config``, ``forward_step`` and ``profiling`` re-export (Bridge's
import paths). One folder per concern below it: ``step/``, ``optim/``, ``checkpointing/``, ``resilience/``,
``observability/``, ``utils/``.

May import: core, config, models, data, parallel, peft, conversion, inference, planner.
"""
