"""Rank-aware logging helpers.

Library code logs through ``logging``; these helpers decide which rank speaks. Megatron prints the training
log from the last rank (the one that holds the loss under pipeline parallelism) and most other messages
from rank 0.
"""

from __future__ import annotations

import logging
import os
import sys

_CONFIGURED = False


def get_rank() -> int:
    """Global rank: from torch.distributed when initialized, else from the launcher's environment."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))


def get_world_size() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1")))


def is_rank_0() -> bool:
    return get_rank() == 0


def is_last_rank() -> bool:
    return get_rank() == get_world_size() - 1


class _StdoutHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stdout`` is when a record is emitted (redirections and captures included)."""

    def __init__(self) -> None:
        super().__init__(sys.stdout)

    @property  # type: ignore[override]
    def stream(self):  # noqa: ANN201 - logging's own attribute
        return sys.stdout

    @stream.setter
    def stream(self, value) -> None:  # noqa: ANN001
        pass


def setup_logging(level: int | None = None) -> None:
    """Configure the ``longspan`` logger once: plain messages on stdout, level INFO unless told."""
    global _CONFIGURED
    root = logging.getLogger("longspan")
    root.setLevel(level if level is not None else logging.INFO)
    if not _CONFIGURED:
        handler = _StdoutHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        root.addHandler(handler)
        root.propagate = False
        _CONFIGURED = True


def get_logger(name: str) -> logging.Logger:
    """A logger under the ``longspan`` hierarchy (pass ``__name__``)."""
    return logging.getLogger(name if name.startswith("longspan") else f"longspan.{name}")


_log = get_logger("longspan")


def print_rank_0(message: str, logger: logging.Logger | None = None) -> None:
    """Log ``message`` at INFO on global rank 0 only."""
    if is_rank_0():
        (logger or _log).info(message)


def print_rank_last(message: str, logger: logging.Logger | None = None) -> None:
    """Log ``message`` at INFO on the last global rank only (Megatron's training-log rank)."""
    if is_last_rank():
        (logger or _log).info(message)


def warn_rank_0(message: str, logger: logging.Logger | None = None) -> None:
    if is_rank_0():
        (logger or _log).warning(message)
