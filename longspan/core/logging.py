"""Rank-aware logging helpers.

Library code logs through ``logging``; these helpers decide which rank speaks. Megatron prints the training
log from the last rank (the one that holds the loss under pipeline parallelism) and most other messages
from rank 0.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

_CONFIGURED = False


def get_rank() -> int:
    """Global rank: from torch.distributed when initialized, else from the launcher's environment."""
    import torch.distributed as dist  # start-up time: the CLI logs through this module before it needs torch

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))


def get_world_size() -> int:
    """World size: from torch.distributed when initialized, else from the launcher's environment."""
    import torch.distributed as dist  # start-up time: the CLI logs through this module before it needs torch

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


# ---- LoggerConfig's filters (filter_warnings, modules_to_filter, set_level_for_all_loggers) -------------------
_INSTALLED_FILTERS: list[tuple[Any, logging.Filter]] = []


class _ThirdPartyWarningFilter(logging.Filter):
    """Drops WARNING records of loggers outside longspan (longspan's own warnings are about the user's settings)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno == logging.WARNING and not record.name.startswith("longspan"))


class _ModuleFilter(logging.Filter):
    """Drops every record of the loggers named by a prefix in ``modules``."""

    def __init__(self, modules: list[str]) -> None:
        super().__init__()
        self.modules = tuple(modules)

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(record.name == m or record.name.startswith(m + ".") for m in self.modules)


def configure_log_filters(
    level: int | None = None,
    filter_warnings: bool = True,
    modules_to_filter: list[str] | None = None,
    set_level_for_all_loggers: bool = False,
) -> None:
    """Apply LoggerConfig's logging switches (as Megatron Bridge's ``setup_logging``); calling it again replaces
    the filters of the previous call.

    ``filter_warnings`` drops WARNING records of third-party loggers; ``modules_to_filter`` drops every record
    of the named loggers (prefixes); both are installed on every existing logger and on the handlers of the
    root and ``longspan`` loggers, so records from loggers created later are filtered too.
    ``set_level_for_all_loggers`` sets ``level`` (INFO when None) on the root and every existing logger.
    """
    for target, installed in _INSTALLED_FILTERS:
        target.removeFilter(installed)
    _INSTALLED_FILTERS.clear()
    filters: list[logging.Filter] = []
    if filter_warnings:
        filters.append(_ThirdPartyWarningFilter())
    if modules_to_filter:
        filters.append(_ModuleFilter(list(modules_to_filter)))
    targets: list[Any] = [logging.getLogger(), logging.getLogger("longspan")]
    targets += [obj for obj in logging.root.manager.loggerDict.values() if isinstance(obj, logging.Logger)]
    for lg in (logging.getLogger(), logging.getLogger("longspan")):
        targets += lg.handlers
    for target in targets:
        for installed in filters:
            target.addFilter(installed)
            _INSTALLED_FILTERS.append((target, installed))
    if set_level_for_all_loggers:
        value = level if level is not None else logging.INFO
        logging.getLogger().setLevel(value)
        for obj in logging.root.manager.loggerDict.values():
            if isinstance(obj, logging.Logger):
                obj.setLevel(value)
