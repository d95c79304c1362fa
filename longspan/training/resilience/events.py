"""One resilience event = one log line + one ``progress.txt`` entry + one ``metrics.jsonl`` record."""

from __future__ import annotations

import json
import os
import time
from typing import Any, Optional

from longspan.core.logging import get_logger, get_rank
from longspan.training.observability.progress_log import append_to_progress_log, format_progress_line
from longspan.training.state import GlobalState

logger = get_logger(__name__)


def report_event(state: GlobalState, kind: str, message: str, *, all_ranks: bool = False, **fields: Any) -> None:
    """Record a resilience event (``kind``: e.g. ``rerun``, ``fault``, ``straggler``, ``non_persistent_save``).

    The log line is printed by rank 0 (every rank with ``all_ranks``); ``{checkpoint.save}/progress.txt`` is written
    by rank 0 with no barrier (an event may concern one rank only); metrics.jsonl by the rank that owns the metrics sink (last).
    """
    cfg = state.cfg
    step = int(state.train_state.step)
    line = f"resilience: {kind}: {message}"
    if all_ranks or get_rank() == 0:
        logger.warning(line) if kind in ("fault", "rerun", "straggler") else logger.info(line)
    save_dir = cfg.checkpoint.save if cfg is not None and cfg.checkpoint is not None else None
    if save_dir:  # resilience events go to progress.txt whether or not logger.log_progress is on
        append_to_progress_log(save_dir, f"Resilience event\t{kind}\t{message}", barrier=False)
    sink = state.metrics_logger if cfg is not None else None
    if sink is not None:
        record = {"phase": "resilience", "event": kind, "iteration": step, "time": time.time(), "message": message}
        record.update({k: v for k, v in fields.items() if v is not None})
        sink.write(record)
        sink.flush()


def append_event_files(save_dir: Optional[str], metrics_path: Optional[str], world_size: int, kind: str,
                       message: str, record: dict[str, Any]) -> None:
    """The files' part of an event reported from outside a run (the launcher's monitor, the in-process
    supervisor): a ``{save_dir}/progress.txt`` entry and a ``metrics_path`` record (None fields left out)."""
    if save_dir:
        os.makedirs(save_dir, exist_ok=True)
        with open(os.path.join(save_dir, "progress.txt"), "a", encoding="utf-8") as fh:
            fh.write(format_progress_line(f"Resilience event\t{kind}\t{message}", world_size))
    if metrics_path:
        os.makedirs(os.path.dirname(os.path.abspath(metrics_path)), exist_ok=True)
        entry = {"phase": "resilience", "event": kind, "time": time.time(), "message": message,
                 **{k: v for k, v in record.items() if v is not None}}
        with open(metrics_path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(entry) + "\n")
