"""The launcher side of fault tolerance, used by ``longspan pretrain --nproc-per-node`` (cli/pretrain_cmd.py)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import threading
from typing import Any, Callable, Iterator

from longspan.core.errors import LaunchError
from longspan.training.resilience.heartbeat import HEARTBEAT_DIR_ENV, HeartbeatMonitor, monitor_reporter

#: nvidia-resiliency-ext's ft_launcher defaults
DEFAULT_INITIAL_RANK_HEARTBEAT_TIMEOUT = 3600.0
DEFAULT_RANK_HEARTBEAT_TIMEOUT = 2700.0


def _timeout(value: Any, flag: str, default: float) -> float:
    if value is None:
        return default
    if not value > 0:
        raise LaunchError(f"{flag}={value} is not valid: use a positive number of seconds")
    return float(value)


@contextlib.contextmanager
def fault_tolerance_monitor(cfg: Any, args: Any, world_size: int) -> Iterator[dict[str, str]]:
    """With ``ft.enable_ft_package``: a heartbeat directory and a monitor thread for the launch's duration;
    yields the environment the workers need ({} when fault tolerance is off)."""
    if args.max_restarts < 0:
        raise LaunchError(f"--max-restarts={args.max_restarts} is not valid: use 0 or a positive number")
    initial = _timeout(args.ft_initial_rank_heartbeat_timeout, "--ft-initial-rank-heartbeat-timeout",
                       DEFAULT_INITIAL_RANK_HEARTBEAT_TIMEOUT)
    rank = _timeout(args.ft_rank_heartbeat_timeout, "--ft-rank-heartbeat-timeout", DEFAULT_RANK_HEARTBEAT_TIMEOUT)
    # A restarted worker group must not meet the previous one's process-group keys in a shared rendezvous store
    # (its gloo ranks would connect to dead peers): each group's rank 0 hosts a fresh store instead.
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if args.max_restarts > 0 else {}
    if cfg.ft is None or not cfg.ft.enable_ft_package:
        yield env
        return
    # loggers import torch: the launcher's fault-tolerance monitor runs without it (start-up time)
    from longspan.training.observability.loggers import metrics_jsonl_path

    given = os.environ.get(HEARTBEAT_DIR_ENV)
    directory = given or tempfile.mkdtemp(prefix="longspan_ft_")
    os.makedirs(directory, exist_ok=True)
    monitor = HeartbeatMonitor(
        directory, initial_timeout=initial, rank_timeout=rank, max_restarts=args.max_restarts,
        report=monitor_reporter(cfg.checkpoint.save, metrics_jsonl_path(cfg), world_size), watch_spawned=True,
    )
    monitor.start()
    previous = _on_child_exit(monitor.exits.collect)
    try:
        yield {**env, HEARTBEAT_DIR_ENV: directory}
    finally:
        if previous is not None:
            signal.signal(signal.SIGCHLD, previous)
        monitor.stop()
        if not given:
            shutil.rmtree(directory, ignore_errors=True)


def _on_child_exit(collect: Callable[[], None]) -> Any:
    """Call ``collect`` whenever a child of this process ends (SIGCHLD; main thread only, where torch elastic's
    agent runs: the handler runs there before the agent reaps the child and stops its peers, so the monitor
    learns which rank ended first even when its own thread is late). Returns the previous handler, or None when
    none was installed (not the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def handler(_signum: int, _frame: Any) -> None:
        try:
            collect()
        except Exception:  # a signal handler must not raise into torch elastic's loop
            pass

    previous = signal.signal(signal.SIGCHLD, handler)
    signal.siginterrupt(signal.SIGCHLD, False)  # system calls a child's end interrupts resume (rendezvous sockets)
    return previous
