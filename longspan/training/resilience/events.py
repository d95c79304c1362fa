"""One resilience event = one log line + one ``progress.txt`` entry + one ``metrics.jsonl`` record."""

from __future__ import annotations

import time
from typing import Any

from longspan.core.logging import get_logger, get_rank
from longspan.training.utils.progress_log import append_to_progress_log

logger = get_logger(__name__)


def report_event(state: Any, kind: str, message: str, *, all_ranks: bool = False, **fields: Any) -> None:
    """Record a resilience event (``kind``: e.g. ``rerun``, ``fault``, ``straggler``, ``non_persistent_save``).

    The log line is printed by rank 0 (every rank with ``all_ranks``); ``{checkpoint.save}/progress.txt`` is written
    by rank 0 with no barrier (an event may concern one rank only); metrics.jsonl by the rank that owns the metrics sink (last).
    """
    cfg = getattr(state, "cfg", None)
    step = int(getattr(getattr(state, "train_state", None), "step", 0))
    line = f"resilience: {kind}: {message}"
    if all_ranks or get_rank() == 0:
        logger.warning(line) if kind in ("fault", "rerun", "straggler") else logger.info(line)
    save_dir = getattr(getattr(cfg, "checkpoint", None), "save", None)
    if save_dir:  # resilience events go to progress.txt whether or not logger.log_progress is on
        append_to_progress_log(save_dir, f"Resilience event\t{kind}\t{message}", barrier=False)
    sink = getattr(state, "metrics_logger", None) if cfg is not None else None
    if sink is not None:
        record = {"phase": "resilience", "event": kind, "iteration": step, "time": time.time(), "message": message}
        record.update({k: v for k, v in fields.items() if v is not None})
        sink.write(record)
        sink.flush()
