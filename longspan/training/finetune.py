"""``finetune(config, forward_step_func)``: pretrain's loop starting from pretrained weights."""

from __future__ import annotations

from typing import Any, Callable, Optional

from longspan.core.errors import ConfigError
from longspan.training.pretrain import pretrain
from longspan.training.state import GlobalState


def finetune(config: Any, forward_step_func: Optional[Callable] = None) -> GlobalState:
    """Like ``pretrain``, but requires weights to start from.

    ``checkpoint.pretrained_checkpoint`` loads weights only (iteration 0, fresh optimizer and RNG); once the
    finetuning run has saved its own checkpoints, ``checkpoint.load`` resumes it exactly.
    """
    ckpt = config.checkpoint
    if not ckpt.pretrained_checkpoint and not ckpt.load:
        raise ConfigError(
            "finetune needs checkpoint.pretrained_checkpoint (weights to start from) or checkpoint.load (a run to resume)"
        )
    return pretrain(config, forward_step_func)
