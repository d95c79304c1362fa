"""Bridge's import path for profiling (``megatron.bridge.training.profiling``): re-exports
:mod:`longspan.training.observability.profiling`."""

from longspan.training.observability.profiling import *  # noqa: F401,F403
