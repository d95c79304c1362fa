"""A run's logs follow its own directory: a template's TensorBoard directory moves with the run's checkpoints.

A recipe (or a section a file writes whole, such as ``config show`` output) puts its logs beside its checkpoints:
``runs/tiny/tensorboard`` and ``runs/tiny/checkpoints``. A run given its own ``checkpoint.save`` is another run,
so, unless ``logger.tensorboard_dir`` was itself chosen (a dotlist key, a YAML file's field, Python code that set
another value), its TensorBoard logs and ``metrics.jsonl`` go beside its own checkpoints, and one line says so.
A value the user set is never replaced.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Optional

from longspan.config.explicit import is_template_value, template_value
from longspan.core.logging import get_logger, print_rank_0

if TYPE_CHECKING:
    from longspan.config.schema.container import ConfigContainer

_log = get_logger(__name__)


def run_directory(checkpoint_save: str) -> str:
    """The run's directory: the parent of a ``.../checkpoints`` save directory, else the save directory itself."""
    save = os.path.normpath(checkpoint_save)
    return os.path.dirname(save) if os.path.basename(save) == "checkpoints" else save


def follow_run_directory(cfg: "ConfigContainer") -> None:
    """Move a template's ``logger.tensorboard_dir`` to this run's directory when ``checkpoint.save`` is the run's
    own (validate() runs it; once moved, the value is no longer the template's, so it is said once)."""
    logger_cfg, ckpt = cfg.logger, cfg.checkpoint
    tb_dir = logger_cfg.tensorboard_dir if logger_cfg is not None else None
    save = ckpt.save if ckpt is not None else None
    if not tb_dir or not save or not is_template_value(cfg, "logger.tensorboard_dir", tb_dir):
        return
    if is_template_value(cfg, "checkpoint.save", save):
        return  # the template's own run
    moved = _beside(tb_dir, template_value(cfg, "checkpoint.save"), save)
    if os.path.normpath(moved) == os.path.normpath(tb_dir):
        return
    logger_cfg.tensorboard_dir = moved
    print_rank_0(f"> logger.tensorboard_dir={moved}: this run's logs follow its checkpoint.save ({tb_dir} is "
                 "another run's); set logger.tensorboard_dir to choose", _log)


def _beside(tb_dir: str, template_save: Optional[str], save: str) -> str:
    """Where the template's ``tb_dir`` sits relative to its run directory, in this run's directory."""
    run_dir = run_directory(save)
    if template_save:
        template_run = run_directory(template_save)
        relative = os.path.relpath(os.path.normpath(tb_dir), template_run)
        if not relative.startswith(os.pardir) and relative != os.curdir:
            return os.path.join(run_dir, relative)
    return os.path.join(run_dir, "tensorboard")
