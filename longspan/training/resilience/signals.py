"""Signals that ask the run to save and stop (``train.exit_signal_handler``, SIGTERM by default)."""

from __future__ import annotations

import signal
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from longspan.core.logging import get_logger

logger = get_logger(__name__)


class DistributedSignalHandler:
    """Record that a signal arrived; ``signals_received()`` asks every rank (one all-gather)."""

    def __init__(self, sig: int = signal.SIGTERM) -> None:
        self.sig = sig
        self._received = False
        self._previous: Any = None

    def __enter__(self) -> "DistributedSignalHandler":
        self._received = False
        self._previous = signal.getsignal(self.sig)

        def handler(signum: int, frame: FrameType | None) -> None:
            logger.info(f"received signal {signal.Signals(signum).name}; saving a checkpoint and exiting")
            self._received = True

        signal.signal(self.sig, handler)
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def release(self) -> None:
        if self._previous is not None:
            signal.signal(self.sig, self._previous)
            self._previous = None

    @property
    def received(self) -> bool:
        return self._received

    def signals_received(self) -> list[bool]:
        """Whether each rank has received the signal."""
        if not dist.is_initialized():
            return [self._received]
        flag = torch.tensor([1 if self._received else 0], dtype=torch.int32)
        flags = [torch.zeros_like(flag) for _ in range(dist.get_world_size())]
        dist.all_gather(flags, flag)
        return [bool(f.item()) for f in flags]
