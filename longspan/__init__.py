"""longspan: Megatron Bridge's training layer on PyTorch's own distributed engine."""

__version__ = "0.1.0"


def __getattr__(name: str):  # lazy: `import longspan` stays light
    if name == "AutoBridge":
        # The conversion class with the training layer's checkpoint format plugged in (import_ckpt/export_ckpt):
        # wired here, at the top of the package tree, because conversion sits below training.
        from longspan.conversion import AutoBridge
        from longspan.training.checkpointing.hf_checkpoint import TrainingCheckpointFormat

        if AutoBridge.checkpoint_format is None:
            AutoBridge.checkpoint_format = TrainingCheckpointFormat()
        return AutoBridge
    raise AttributeError(f"module 'longspan' has no attribute {name!r}")
