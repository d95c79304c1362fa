"""longspan: Megatron Bridge's training layer on PyTorch's own distributed engine."""

__version__ = "0.1.0"


def __getattr__(name: str):  # lazy: `import longspan` stays light
    if name == "AutoBridge":
        from longspan.training.checkpointing.hf_checkpoint import AutoBridge  # the conversion bridge + checkpoint methods

        return AutoBridge
    raise AttributeError(f"module 'longspan' has no attribute {name!r}")
