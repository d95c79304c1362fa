"""longspan: Megatron Bridge's training layer on PyTorch's own distributed engine."""

__version__ = "0.1.0"


def __getattr__(name: str):  # lazy: `import longspan` stays light
    if name == "AutoBridge":
        from longspan.conversion import AutoBridge

        return AutoBridge
    raise AttributeError(f"module 'longspan' has no attribute {name!r}")
