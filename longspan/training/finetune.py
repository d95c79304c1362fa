"""``finetune(config, forward_step_func, callbacks=None)``: pretrain's loop starting from pretrained weights."""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

from longspan.core.errors import ConfigError
from longspan.training.callbacks import Callback, CallbackManager
from longspan.training.checkpointing.load import find_checkpoint
from longspan.training.pretrain import pretrain
from longspan.training.state import GlobalState


def finetune(
    config: Any,
    forward_step_func: Optional[Callable] = None,
    callbacks: Union[list[Callback], CallbackManager, None] = None,
) -> GlobalState:
    """Like ``pretrain``, but requires weights to start from.

    ``checkpoint.pretrained_checkpoint`` loads weights only (iteration 0, fresh optimizer and RNG); once the
    finetuning run has saved its own checkpoints, ``checkpoint.load`` resumes it exactly.
    """
    ckpt = config.checkpoint
    if not ckpt.pretrained_checkpoint and (not ckpt.load or find_checkpoint(ckpt) is None):
        resumable = f" (checkpoint.load={ckpt.load} holds no run to resume yet)" if ckpt.load else ""
        raise ConfigError(
            "finetune needs checkpoint.pretrained_checkpoint: give checkpoint.pretrained_checkpoint=DIR, an HF model "
            f"directory or a longspan checkpoint to start from{resumable}"
        )
    return pretrain(config, forward_step_func, callbacks=callbacks)
