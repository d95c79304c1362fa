"""``longspan pretrain --nproc-per-node N``: start the workers through torch's elastic launcher, in-process.

torchrun wraps any worker failure in its own traceback and exit code 1. ``launch`` uses the same machinery
(``torch.distributed.launcher.api.elastic_launch``) but:

- runs ``python -m <module> <argv>`` in each worker through a tiny shim that records the worker's exit code and,
  for uncaught exceptions, torch elastic's error file (``@record``);
- forwards SIGTERM/SIGINT to the workers (torch elastic sends the signal it received to every worker's
  process group, waits ``shutdown_timeout`` seconds, then SIGKILLs) and returns 0 when every worker then
  exited 0 — a training run saves its checkpoint on SIGTERM and exits cleanly;
- reports a failure as ONE line on stderr naming the global rank, its exit code and its error (the error
  file's message, or the last line of the worker's stderr), plus where the full logs are, and returns 2 when
  that worker exited 2 (a user error) else 1;
- shows every worker's stdout on the console with a ``[rank R]:`` prefix (``local_ranks_filter`` restricts it,
  like torchrun's ``--local-ranks-filter``); worker stderr goes to log files (``tee_stderr=True`` shows it too),
  so N interleaved tracebacks never reach the console.
"""

from __future__ import annotations

import json
import logging
import os
import runpy
import shutil
import signal
import sys
import tempfile
import uuid
from dataclasses import dataclass
from typing import Any, Iterable

from longspan.core.errors import LaunchError
from longspan.core.logging import get_logger
from longspan.core.startup import import_frozen

_log = get_logger(__name__)

#: the worker shim: ``python -c SHIM <exitcode_dir> <module> <argv...>``
_SHIM = "import longspan.parallel.launcher as _l; _l._worker_entry()"


def parse_nnodes(nnodes: str | int) -> tuple[int, int]:
    """``"2"`` -> (2, 2); ``"1:4"`` -> (1, 4) (elastic min:max), as torchrun parses ``--nnodes``."""
    text = str(nnodes).strip()
    try:
        parts = [int(p) for p in text.split(":")]
    except ValueError:
        parts = []
    if len(parts) == 1:
        parts = parts * 2
    if len(parts) != 2 or not 1 <= parts[0] <= parts[1]:
        raise LaunchError(f"--nnodes={nnodes!r} is not valid; use a positive number N or MIN:MAX with MIN <= MAX")
    return parts[0], parts[1]


@dataclass
class WorkerFailure:
    """One failed worker, as read back after the run."""

    rank: int
    local_rank: int
    exitcode: int
    message: str
    log_file: str | None = None


def last_log_line(path: str | None) -> str:
    """The last non-blank line of a worker's log file ("" when there is none)."""
    if not path or not os.path.isfile(path):
        return ""
    with open(path, errors="replace") as fh:
        lines = [ln.strip() for ln in fh.read().splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def _error_file_message(path: str | None) -> str:
    if not path or not os.path.isfile(path):
        return ""
    try:
        with open(path) as fh:
            data = json.load(fh)
        msg = data.get("message", "")
        if isinstance(msg, dict):
            msg = msg.get("message", "")
        return str(msg).strip().splitlines()[-1] if str(msg).strip() else ""
    except (OSError, ValueError, AttributeError):
        return ""


def format_failure(failure: WorkerFailure) -> str:
    """The one line that reports a failed worker."""
    if failure.exitcode < 0:
        try:
            how = f"was killed by {signal.Signals(-failure.exitcode).name}"
        except ValueError:
            how = f"was killed by signal {-failure.exitcode}"
    else:
        how = f"exited with code {failure.exitcode}"
    line = f"longspan: error: rank {failure.rank} {how}"
    if failure.message:
        line += f": {failure.message.removeprefix('longspan: error: ')}"
    if failure.log_file:
        line += f" (full log: {failure.log_file})"
    return line


def _pick_failure(failures: dict[int, Any], logs: Any, exit_dir: str) -> WorkerFailure:
    """The root-cause failure: a worker that exited on its own (code > 0) before one killed by a signal,
    then the earliest error file, then the lowest rank; among those, the first whose error file or log gives a
    reason (a user error is printed by one rank only, the others exit with the same code and an empty log)."""
    def key(item: tuple[int, Any]) -> tuple:
        rank, f = item
        return (f.exitcode < 0, f.timestamp, rank)

    picked = [_read_failure(rank, f, logs) for rank, f in sorted(failures.items(), key=key)]
    # a worker killed by a signal never stands in for one that exited on its own
    with_reason = [w for w in picked if w.message and (w.exitcode < 0) == (picked[0].exitcode < 0)]
    return with_reason[0] if with_reason else picked[0]


def _read_failure(rank: int, f: Any, logs: Any) -> WorkerFailure:
    log_file = getattr(logs, "stderrs", {}).get(f.local_rank) if logs is not None else None
    message = _error_file_message(f.error_file) or last_log_line(log_file)
    return WorkerFailure(rank=rank, local_rank=f.local_rank, exitcode=f.exitcode, message=message,
                         log_file=log_file)


def launch(
    argv: list[str],
    nproc_per_node: int,
    nnodes: str = "1",
    rdzv_backend: str = "c10d",
    rdzv_endpoint: str | None = None,
    node_rank: int = 0,
    *,
    module: str = "longspan",
    rdzv_id: str | None = None,
    max_restarts: int = 0,
    log_dir: str | None = None,
    local_ranks_filter: Iterable[int] | None = None,
    tee_stderr: bool = False,
    shutdown_timeout: int = 60,
    monitor_interval: float = 0.1,
    extra_env: dict[str, str] | None = None,
    quiet_torch_logs: bool = True,
) -> int:
    """Run ``python -m <module> <argv>`` on ``nproc_per_node`` local workers (× nnodes); return an exit code.

    Single node (``nnodes="1"``, no ``rdzv_endpoint``): a private c10d rendezvous on a free local port (like
    ``torchrun --standalone``). Multi-node: every node calls ``launch`` with the same ``nnodes``,
    ``rdzv_endpoint="host:port"`` and ``rdzv_id``; with ``rdzv_backend="static"`` also ``node_rank``.
    ``extra_env`` is added to each worker's environment. ``quiet_torch_logs`` silences torch elastic's own
    warning/error lines (they would repeat the failure in a second format). Returns 0 on success (or after a forwarded
    SIGTERM/SIGINT when every worker exited 0), 2 when the failing worker exited 2, else 1. Bad launch
    arguments raise LaunchError.
    """
    if isinstance(nproc_per_node, bool) or not isinstance(nproc_per_node, int) or nproc_per_node < 1:
        raise LaunchError(f"--nproc-per-node={nproc_per_node!r} must be a positive integer")
    rdzv = _rendezvous(nnodes, rdzv_backend, rdzv_endpoint, node_rank, rdzv_id)
    filter_set = set(local_ranks_filter) if local_ranks_filter is not None else None

    # torch elastic on first use: the CLI's start-up (--help, one-line config errors) does not load torch
    from torch.distributed.elastic.multiprocessing import SignalException, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # (same reason)
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch  # (same reason)

    exit_dir = tempfile.mkdtemp(prefix="longspan_exit_")
    logs = _make_recording_logs_specs()(log_dir=log_dir, redirects=Std.ALL,
                               tee=Std.ALL if tee_stderr else Std.OUT, local_ranks_filter=filter_set)
    config = LaunchConfig(
        min_nodes=rdzv.min_nodes, max_nodes=rdzv.max_nodes, nproc_per_node=nproc_per_node,
        run_id=rdzv.run_id or str(uuid.uuid4()), role="longspan", rdzv_endpoint=rdzv.endpoint,
        rdzv_backend=rdzv.backend, rdzv_configs=rdzv.configs,
        max_restarts=max_restarts, monitor_interval=monitor_interval, start_method="spawn", logs_specs=logs,
        log_line_prefix_template="[rank${rank}]:", shutdown_timeout=shutdown_timeout,
        signals_to_handle="SIGTERM,SIGINT,SIGHUP,SIGQUIT",
    )
    shim_args = ["-c", _SHIM, exit_dir, module, *argv]
    saved_handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)}
    saved_env = {k: os.environ.get(k) for k in (extra_env or {})}
    saved_levels = _quiet_torch_elastic_logs() if quiet_torch_logs else {}
    os.environ.update(extra_env or {})  # workers inherit the launcher's environment
    try:
        elastic_launch(config, sys.executable)(*shim_args)
        if log_dir is None:  # our own temporary logs: keep them only when something failed
            _rmtree_quiet(logs.root)
        return 0
    except ChildFailedError as err:
        failure = _pick_failure(err.failures, logs.last, exit_dir)
        sys.stderr.write(format_failure(failure) + "\n")
        sys.stderr.flush()
        return 2 if failure.exitcode == 2 else 1
    except SignalException as sig:
        return _after_forwarded_signal(signal.Signals(sig.sigval), exit_dir, nproc_per_node, logs.root,
                                       remove_logs=log_dir is None)
    finally:
        _restore_launcher_process(saved_handlers, saved_levels, saved_env)
        _rmtree_quiet(exit_dir)


def _restore_launcher_process(handlers: dict[int, Any], log_levels: dict[str, int], env: dict[str, str | None]) -> None:
    """Put back the signal handlers, torch elastic's log levels and the environment ``launch`` changed."""
    for sig, handler in handlers.items():
        signal.signal(sig, handler)
    for name, level in log_levels.items():
        logging.getLogger(name).setLevel(level)
    for key, value in env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@dataclass(frozen=True)
class _Rendezvous:
    min_nodes: int
    max_nodes: int
    backend: str
    endpoint: str
    run_id: str | None
    configs: dict[str, Any]


def _rendezvous(nnodes: str, backend: str, endpoint: str | None, node_rank: int, run_id: str | None) -> _Rendezvous:
    """The rendezvous the launch arguments describe (a private local one on a single node); LaunchError
    for arguments that do not fit together."""
    min_nodes, max_nodes = parse_nnodes(nnodes)
    if backend not in ("c10d", "static", "etcd", "etcd-v2"):
        raise LaunchError(f"--rdzv-backend={backend!r} is not valid; use c10d (default) or static")
    configs: dict[str, Any] = {}
    if endpoint is None:
        if max_nodes > 1:
            raise LaunchError(f"--nnodes={nnodes} needs --rdzv-endpoint HOST:PORT (the same on every node)")
        endpoint = "localhost:0"
        backend = "c10d"
    if backend == "static":
        if not 0 <= node_rank < max_nodes:
            raise LaunchError(f"--node-rank={node_rank} is not in [0, {max_nodes}) for --nnodes={nnodes}")
        configs["rank"] = node_rank
    if max_nodes > 1 and run_id is None and backend != "static":
        run_id = os.environ.get("SLURM_JOB_ID") or "longspan"  # must agree across nodes
    return _Rendezvous(min_nodes, max_nodes, backend, endpoint, run_id, configs)


def _after_forwarded_signal(sig: signal.Signals, exit_dir: str, nproc_per_node: int, log_root: str,
                            remove_logs: bool) -> int:
    """0 when every worker exited cleanly after the forwarded signal, else one error line and 128 + signal."""
    codes = _exit_codes(exit_dir)
    if len(codes) == nproc_per_node and all(c == 0 for c in codes.values()):
        if remove_logs:
            _rmtree_quiet(log_root)
        _log.info(f"longspan: {sig.name} forwarded to {nproc_per_node} workers; all exited cleanly")
        return 0
    bad = sorted(r for r, c in codes.items() if c != 0)
    missing = nproc_per_node - len(codes)
    sys.stderr.write(f"longspan: error: {sig.name} received; workers did not all exit cleanly "
                     f"(nonzero ranks: {bad}, {missing} killed or unreported; logs: {log_root})\n")
    return 128 + int(sig)


def _make_recording_logs_specs() -> type:
    # torch elastic on first use (see launch)
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

    class RecordingLogsSpecs(DefaultLogsSpecs):
        """DefaultLogsSpecs that remembers the last LogsDest, so failures can point at their stderr file."""

        last: Any = None

        def reify(self, envs: dict[int, dict[str, str]]) -> Any:
            self.last = super().reify(envs)
            return self.last

        @property
        def root(self) -> str:
            return str(self.root_log_dir)

    return RecordingLogsSpecs


def _quiet_torch_elastic_logs() -> dict[str, int]:
    """Raise torch elastic's loggers to CRITICAL; return their previous levels for restoring."""
    # torch elastic on first use (see launch); imported here so that its loggers exist
    import torch.distributed.elastic.agent.server.api  # noqa: F401
    import torch.distributed.launcher.api  # noqa: F401

    saved = {}
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.distributed.launcher")):
            saved[name] = logging.getLogger(name).level
            logging.getLogger(name).setLevel(logging.CRITICAL)
    return saved


def _exit_codes(exit_dir: str) -> dict[int, int]:
    codes = {}
    for name in os.listdir(exit_dir):
        try:
            with open(os.path.join(exit_dir, name)) as fh:
                codes[int(name)] = int(fh.read().strip())
        except (OSError, ValueError):
            continue
    return codes


def _rmtree_quiet(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def _worker_entry() -> None:
    """Worker side of the shim: run ``python -m <module> <argv>`` and record the exit code by global rank."""
    exit_dir, module, *rest = sys.argv[1:]
    rank = os.environ.get("RANK", "0")
    code: int = 1

    def write_code() -> None:
        tmp = os.path.join(exit_dir, f".{rank}.tmp")
        try:
            with open(tmp, "w") as fh:
                fh.write(str(code))
            os.replace(tmp, os.path.join(exit_dir, rank))
        except OSError:
            pass

    # the worker's own process: torch loads with the collector paused, as `longspan` loads the trainer after it
    import_frozen(["torch.distributed.elastic.multiprocessing.errors"])
    from torch.distributed.elastic.multiprocessing.errors import record  # torch elastic on first use (see launch)

    @record
    def run() -> None:
        sys.argv = [module, *rest]
        runpy.run_module(module, run_name="__main__", alter_sys=True)

    try:
        run()
        code = 0
    except SystemExit as exc:
        if exc.code is None:
            code = 0
        elif isinstance(exc.code, int):
            code = exc.code
        else:
            code = 1
        raise
    finally:
        write_code()
