"""Bridge's import path for the GPT forward step (``megatron.bridge.training.gpt_step``): re-exports
:mod:`longspan.training.step.forward_step`, where it lives with the other step functions."""

from longspan.training.step.forward_step import *  # noqa: F401,F403
from longspan.training.step.forward_step import forward_step  # noqa: F401
