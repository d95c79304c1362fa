"""In-process multi-process test harness: run a function on N ranks, get N results back.

Why: starting a Python process that imports torch costs seconds on this machine, so a test suite that
spawns fresh processes for every layout spends its time importing. ``WorkerPool`` starts N persistent
worker processes once (``spawn``) and then runs any number of submitted callables on all of them.

Usage::

    from tests.parallel.harness import WorkerPool, init_gloo

    def _allreduce_case(x):                 # module level: it is pickled by reference
        import torch, torch.distributed as dist
        init_gloo()                          # or longspan.parallel.init.initialize_distributed(...)
        t = torch.tensor([float(x + dist.get_rank())])
        dist.all_reduce(t)
        return t.item()

    def test_allreduce(pool2):               # session-scoped fixture from tests/parallel/conftest.py
        assert pool2.run(_allreduce_case, 1.0) == [3.0, 3.0]

What every task sees (set fresh per task):
- env ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK=0``, ``MASTER_ADDR=127.0.0.1``,
  ``MASTER_PORT`` (a new free port from the OS for every task), ``GLOO_SOCKET_IFNAME=lo``,
  ``OMP_NUM_THREADS=1`` (and ``torch.set_num_threads(1)``), ``LONGSPAN_TEST_WORKER=1``; the parent's
  ``sys.path``; the current directory of the parent.
- No process group: the task creates one (``init_gloo()`` or longspan's ``initialize_distributed``). After
  the task, whatever it left is torn down: ``longspan.parallel.init.destroy_distributed()`` when longspan's
  init was imported, then ``torch.distributed.destroy_process_group()``. Do not rely on other state surviving
  between tasks (seed your RNGs inside the task; module globals of imported modules do survive).

Contract:
- ``pool.run(fn, *args, timeout=..., **kwargs) -> list`` returns ``fn``'s return value per rank (index = rank).
  ``fn``, its arguments and its return values must be picklable (plain pickle: tensors are fine).
  ``pool.run_per_rank(fn, [args_rank0, args_rank1, ...])`` gives each rank its own arguments.
- A task that raises on any rank raises ``WorkerError`` in the parent naming the rank, the exception and the
  worker's traceback. Other ranks are given a short grace period (``error_grace_s``) to finish, then the pool
  is killed (they are probably stuck in a collective) and restarted lazily on the next ``run``.
- A task that does not finish within ``timeout`` seconds (default 90) raises ``HarnessTimeout`` naming the
  ranks that did not answer; all workers are killed (SIGTERM, then SIGKILL) and restarted on the next run.
  Use short distributed timeouts inside tasks as well (``init_gloo(timeout_s=60)``, or
  ``distributed_timeout_minutes=1``).
- Workers die with the parent (Linux ``PR_SET_PDEATHSIG``, plus an ``atexit`` hook that closes every pool).

Fixtures (tests/parallel/conftest.py): ``pool2`` and ``pool4`` are session-scoped shared pools. Tests in other
directories can reuse them by importing the fixtures into their own conftest::

    from tests.parallel.conftest import pool2, pool4  # noqa: F401

or call ``get_shared_pool(n)`` directly. One-off runs: ``run_distributed(fn, world_size, *args)``.

Keep this module free of a top-level ``import torch``: worker processes import it before they have set
``OMP_NUM_THREADS``.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pickle
import queue as queue_mod
import random
import signal
import socket
import sys
import time
import traceback
from typing import Any, Callable, Sequence

#: default hard timeout of one ``run`` (seconds)
DEFAULT_TIMEOUT_S = 90.0
#: how long a worker pool may take to start (spawn + import torch on a busy 2-core machine)
DEFAULT_START_TIMEOUT_S = 120.0


class WorkerError(RuntimeError):
    """A task raised on a worker; ``rank``, ``exc_type``, ``message`` and ``remote_traceback`` say where/what."""

    def __init__(self, rank: int, exc_type: str, message: str, remote_traceback: str) -> None:
        self.rank = rank
        self.exc_type = exc_type
        self.message = message
        self.remote_traceback = remote_traceback
        super().__init__(f"rank {rank} raised {exc_type}: {message}\n--- traceback on rank {rank} ---\n"
                         f"{remote_traceback}")


class HarnessTimeout(TimeoutError):
    """A task (or the pool start-up) did not finish in time; the pool has been killed."""


def _below_ephemeral_ports() -> range:
    """Ports under the kernel's ephemeral range (Linux: ``ip_local_port_range``, 32768-60999 by default)."""
    low = 32768
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    return range(max(1024, low - 12000), low)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now, for a rank 0 (or rendezvous agent) to listen on soon.

    Chosen below the ephemeral range, at random: a port the kernel picked for ``bind(0)`` lies in the range it
    also hands out to outgoing connections, and with gloo meshes in other tests connecting all the time, one
    of them took such a port before rank 0 listened on it (EADDRINUSE). ``SystemRandom`` because tests seed
    ``random``, which would make every xdist worker try the same ports in the same order."""
    ports = _below_ephemeral_ports()
    pick = random.SystemRandom()
    for _ in range(100 if ports else 0):
        port = pick.choice(ports)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # a crowded or empty range: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo(timeout_s: float = 60.0) -> None:
    """Inside a task: initialize the default gloo process group from the harness's environment."""
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))


# ----------------------------------------------------------------------------------------------- worker side

def _set_parent_death_signal() -> None:
    """Ask Linux to SIGKILL this worker when its parent dies, so a crashed pytest leaves no orphans."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(Exception):
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)


def _cleanup_after_task() -> None:
    if "longspan.parallel.init" in sys.modules:
        with contextlib.suppress(Exception):
            sys.modules["longspan.parallel.init"].destroy_distributed()
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _worker_main(rank: int, world_size: int, base_env: dict, task_q: Any, result_q: Any, parent_pid: int) -> None:
    _set_parent_death_signal()
    os.environ.update(base_env)
    from longspan.core.startup import import_frozen

    # what `longspan` does at start: the trainer's ~300k module objects frozen, out of every collection
    import_frozen(["torch", "longspan.training.finetune"])
    import torch

    torch.set_num_threads(1)
    result_q.put(("ready", None, rank, os.getpid()))
    while True:
        try:
            msg = task_q.get(timeout=1.0)
        except queue_mod.Empty:
            if os.getppid() != parent_pid:
                return  # parent is gone
            continue
        if msg is None:
            return
        task_id, payload, task_env, sys_path, cwd = msg
        for entry in sys_path:
            if entry not in sys.path:
                sys.path.append(entry)
        os.environ.update(task_env)
        with contextlib.suppress(OSError):
            os.chdir(cwd)
        try:
            fn, args, kwargs = pickle.loads(payload)
            result = fn(*args, **kwargs)
            out = pickle.dumps(result)
            result_q.put(("ok", task_id, rank, out))
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the parent
            result_q.put(("err", task_id, rank, (type(exc).__name__, str(exc), traceback.format_exc())))
        finally:
            _cleanup_after_task()


# ----------------------------------------------------------------------------------------------- parent side

@contextlib.contextmanager
def _patched_environ(updates: dict[str, str]):
    old = {k: os.environ.get(k) for k in updates}
    os.environ.update(updates)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class WorkerPool:
    """N persistent worker processes that run submitted callables SPMD-style (see the module docstring)."""

    def __init__(self, world_size: int, *, start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
                 error_grace_s: float = 3.0, env: dict[str, str] | None = None) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.start_timeout_s = start_timeout_s
        self.error_grace_s = error_grace_s
        self.extra_env = dict(env or {})
        self._procs: list[Any] = []
        self._task_qs: list[Any] = []
        self._result_q: Any = None
        self._next_task = 0
        self.starts = 0  # how many times the workers were (re)started; tests use it

    # -- lifecycle
    @property
    def alive(self) -> bool:
        """Whether all workers are running."""
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def start(self) -> None:
        """Start the workers (no-op when already running); waits until each has imported torch."""
        if self.alive:
            return
        self.close()
        import torch.multiprocessing as tmp

        ctx = tmp.get_context("spawn")
        base_env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
                    "MASTER_ADDR": "127.0.0.1", "LONGSPAN_TEST_WORKER": "1",
                    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", **self.extra_env}
        self._result_q = ctx.Queue()
        self._task_qs = [ctx.Queue() for _ in range(self.world_size)]
        # OMP_NUM_THREADS must be in the environment before the child imports torch
        with _patched_environ({"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}):
            for rank in range(self.world_size):
                p = ctx.Process(target=_worker_main, name=f"harness-rank{rank}",
                                args=(rank, self.world_size, base_env, self._task_qs[rank], self._result_q,
                                      os.getpid()), daemon=False)
                p.start()
                self._procs.append(p)
        self.starts += 1
        ready: set[int] = set()
        deadline = time.monotonic() + self.start_timeout_s
        while len(ready) < self.world_size:
            remaining = deadline - time.monotonic()
            dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
            if remaining <= 0 or dead:
                self.kill()
                why = f"ranks {dead} died" if dead else f"not ready after {self.start_timeout_s:.0f} s"
                raise HarnessTimeout(f"worker pool of {self.world_size} failed to start: {why}")
            try:
                kind, _, rank, _ = self._result_q.get(timeout=min(remaining, 1.0))
            except queue_mod.Empty:
                continue
            if kind == "ready":
                ready.add(rank)

    def kill(self) -> None:
        """Stop all workers now (SIGTERM, then SIGKILL after 2 s)."""
        for p in self._procs:
            if p.is_alive():
                p.terminate()
        deadline = time.monotonic() + 2.0
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(2.0)
        self._procs = []
        for q in [*self._task_qs, self._result_q]:
            if q is not None:
                with contextlib.suppress(Exception):
                    q.close()
                    q.cancel_join_thread()
        self._task_qs, self._result_q = [], None

    def close(self) -> None:
        """Ask workers to exit, then kill whatever is left."""
        if not self._procs:
            return
        for q in self._task_qs:
            with contextlib.suppress(Exception):
                q.put(None)
        deadline = time.monotonic() + 3.0
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
        self.kill()

    def __enter__(self) -> "WorkerPool":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- running tasks
    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = DEFAULT_TIMEOUT_S, **kwargs: Any) -> list:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results indexed by rank."""
        return self.run_per_rank(fn, [args] * self.world_size, [kwargs] * self.world_size, timeout=timeout)

    def run_per_rank(self, fn: Callable[..., Any], args_per_rank: Sequence[Sequence[Any]],
                     kwargs_per_rank: Sequence[dict] | None = None, *,
                     timeout: float = DEFAULT_TIMEOUT_S) -> list:
        """Run ``fn(*args_per_rank[r], **kwargs_per_rank[r])`` on rank r; return the results by rank."""
        if len(args_per_rank) != self.world_size:
            raise ValueError(f"need {self.world_size} argument tuples, got {len(args_per_rank)}")
        kwargs_per_rank = kwargs_per_rank or [{}] * self.world_size
        self.start()
        self._next_task += 1
        task_id = self._next_task
        port = free_port()
        for rank in range(self.world_size):
            env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(self.world_size),
                   "LOCAL_WORLD_SIZE": str(self.world_size), "GROUP_RANK": "0", "MASTER_PORT": str(port)}
            payload = pickle.dumps((fn, tuple(args_per_rank[rank]), dict(kwargs_per_rank[rank])))
            self._task_qs[rank].put((task_id, payload, env, list(sys.path), os.getcwd()))
        return self._collect(task_id, timeout, getattr(fn, "__qualname__", repr(fn)))

    def _collect(self, task_id: int, timeout: float, name: str) -> list:
        results: dict[int, Any] = {}
        first_error: tuple | None = None
        deadline = time.monotonic() + timeout
        while len(results) < self.world_size:
            now = time.monotonic()
            if first_error is not None:
                deadline = min(deadline, first_error[1] + self.error_grace_s)
            if now >= deadline:
                break
            try:
                kind, tid, rank, data = self._result_q.get(timeout=min(0.5, deadline - now))
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in results]
                if dead and first_error is None:
                    self.kill()
                    raise WorkerError(dead[0], "WorkerDied", "worker process exited during the task "
                                      "(killed or os._exit)", "")
                continue
            if tid != task_id:
                continue  # a late answer from an earlier, aborted task
            results[rank] = (kind, data)
            if kind == "err" and first_error is None:
                first_error = (rank, time.monotonic())
        if first_error is not None:
            rank = first_error[0]
            exc_type, message, tb = results[rank][1]
            if len(results) < self.world_size:
                self.kill()  # the other ranks are probably stuck in a collective
            raise WorkerError(rank, exc_type, message, tb)
        if len(results) < self.world_size:
            missing = sorted(set(range(self.world_size)) - set(results))
            self.kill()
            raise HarnessTimeout(f"task {name} timed out after {timeout:.0f} s; "
                                 f"ranks {missing} did not finish (pool killed, restarts on next run)")
        return [pickle.loads(results[r][1]) for r in range(self.world_size)]


# ----------------------------------------------------------------------------------------------- shared pools

_SHARED: dict[int, WorkerPool] = {}

# A safety net: a worker that piles up native threads (gloo groups kept alive by something that still references
# their device mesh; hundreds of polling threads once kept idle workers at a third of a core each) is restarted
# before its next task. longspan's destroy_distributed, which the task cleanup calls, releases them (see
# tests/parallel/test_teardown.py), so a worker now stays at a handful and the pools start once per session.
MAX_WORKER_THREADS = 64


def _thread_count(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return 0


def get_shared_pool(world_size: int) -> WorkerPool:
    """The process-wide pool of ``world_size`` workers (started on first use, restarted when a worker has piled
    up threads, closed at exit)."""
    pool = _SHARED.get(world_size)
    if pool is None:
        pool = _SHARED[world_size] = WorkerPool(world_size)
    elif pool.alive and any(_thread_count(p.pid) > MAX_WORKER_THREADS for p in pool._procs):
        pool.close()
    pool.start()
    return pool


def close_shared_pools() -> None:
    """Close every shared pool (registered with ``atexit``; the conftest also calls it at session end)."""
    for pool in list(_SHARED.values()):
        with contextlib.suppress(Exception):
            pool.close()
    _SHARED.clear()


atexit.register(close_shared_pools)


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = DEFAULT_TIMEOUT_S,
                    **kwargs: Any) -> list:
    """One-off: start ``world_size`` workers, run ``fn`` on them, stop them. Prefer the shared pools."""
    with WorkerPool(world_size) as pool:
        return pool.run(fn, *args, timeout=timeout, **kwargs)
