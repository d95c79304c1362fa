"""longspan: Megatron Bridge's training layer on PyTorch's own distributed engine.

Packages, lowest layer first; a package imports its own layer and the layers to its left, never one to its
right (tests/code asserts it; a function-level import needs a comment saying why):

    core → config → models, data → parallel, peft, conversion → inference, planner → training → recipes
    → families → cli

``import longspan`` loads none of them; ``longspan.AutoBridge`` is resolved on first use. The registries of the
lower layers (config classes, HF architectures, recipes) are filled by the packages above them: this module
installs the loader that imports those packages on the first lookup (``longspan.core.plugins``).
"""

__version__ = "0.1.0"

from longspan.core import plugins as _plugins


def _load_registrants() -> None:
    # The composition root: the packages that register config classes, HF architectures, recipes and plan
    # pieces into the registries below them; imported on the first registry lookup, not by `import longspan`.
    import longspan.models  # noqa: F401  (the model kinds' providers and activation functions)
    import longspan.peft  # noqa: F401  (the PEFT configs)
    import longspan.families  # noqa: F401  (registers every family package)


_plugins.set_loader(_load_registrants)


def __getattr__(name: str):  # lazy: `import longspan` stays light
    if name == "AutoBridge":
        # The conversion class with the training layer's checkpoint format plugged in (import_ckpt/export_ckpt);
        # imported on first use so that `import longspan` does not load torch.
        from longspan.training.checkpointing.hf_checkpoint import auto_bridge

        return auto_bridge()
    raise AttributeError(f"module 'longspan' has no attribute {name!r}")
