"""Checkpoints: ``save_checkpoint`` / ``load_checkpoint`` (Megatron Bridge's names, DCP ``torch_dist``
format), IO checks, asynchronous and non-persistent saves, Hugging Face weights in and out of a run, PEFT
adapter checkpoints, and loading a model from a checkpoint for inference.

May import: everything below training, and training's state, step, optim and observability.
"""

from longspan.training.checkpointing.load import load_checkpoint
from longspan.training.checkpointing.save import save_checkpoint

__all__ = ["load_checkpoint", "save_checkpoint"]
