"""In-process restart, the worker side (``inprocess_restart``).

A worker started by longspan's in-process supervisor (``resilience/supervisor.py``) trains inside a loop:

1. wait at the re-rendezvous barrier of its *generation* (a counter in the supervisor's TCPStore) until every
   rank of that generation has arrived (``barrier_timeout``);
2. create its gloo process group on that generation's own key space of the store (``gen{G}/pg``);
3. run the training function; when it fails because a peer failed (a collective raises once the dead peer's
   sockets close) or is interrupted because the supervisor moved to a newer generation, destroy the process
   groups and longspan's process-wide state (parallel state, compiled-graph caches, the CUDA cache), and go back
   to 1 in the newer generation. The training function then loads the newest checkpoint, as any restart does.

The Python process — and its pid — stays the same; only the failed rank is a new process (started by the
supervisor directly in the current generation). A monitor thread writes this rank's heartbeat and progress
timestamps to the store (the supervisor terminates a frozen rank) and interrupts the main thread when the job's
generation moves on while it still runs an older one.

Progress (nvidia-resiliency-ext's ``ping``): while the training loop runs, the loop reports each finished iteration,
evaluation step and checkpoint save (``report_progress``). A rank without progress for ``soft_timeout`` seconds is
interrupted by its own monitor thread (an exception raised asynchronously in its main thread), which also moves
the job to the next generation: every rank restarts in place. Outside the training loop (start-up, setup, the
test evaluation) the monitor thread's own liveness counts as progress. The progress timestamp the supervisor
reads is the same one, so a rank the exception cannot reach (stuck in a call that never returns to Python) is
terminated at ``hard_timeout``.
"""

from __future__ import annotations

import ctypes
import gc
import os
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Mapping, Optional

from longspan.core.errors import LaunchError, LongspanError
from longspan.core.logging import get_logger
from longspan.parallel.init import destroy_distributed

logger = get_logger(__name__)

#: host:port of the supervisor's TCPStore; its presence marks a supervised worker
STORE_ENV = "LONGSPAN_INPROCESS_STORE"
#: the generation a worker process starts in (a replacement joins the current one)
GENERATION_ENV = "LONGSPAN_INPROCESS_GENERATION"
#: the worker process's place among the supervisor's processes (its rank, unless it is or was a warm reserve)
SLOT_ENV = "LONGSPAN_INPROCESS_SLOT"

GENERATION_KEY = "generation"
FINISHING_KEY = "finishing"  # set by the supervisor once the job ends (a rank exited): nobody restarts any more


def arrived_key(generation: int) -> str:
    return f"gen{generation}/arrived"


def assignment_key(generation: int, slot: int) -> str:
    """The workload rank worker process ``slot`` runs in ``generation``; -1: a warm reserve (active_world_size)."""
    return f"gen{generation}/rank_of/{slot}"


def heartbeat_key(rank: int) -> str:
    return f"heartbeat/{rank}"


def progress_key(rank: int) -> str:
    return f"progress/{rank}"


def soft_timeout_key(rank: int) -> str:
    """Set by a worker's monitor thread that interrupted its rank for lack of progress: ``{generation}:{seconds}``."""
    return f"soft_timeout/{rank}"


def exiting_key(rank: int) -> str:
    """Set by a worker that has finished (its exit code): no more timestamps come, and it is not hung."""
    return f"exiting/{rank}"


class RestartAbort(BaseException):
    """Raised in a worker's main thread when the job moved to a newer generation while it was still training."""


def in_supervised_worker(env: Optional[Mapping[str, str]] = None) -> bool:
    """Whether this process is a worker of the in-process restart supervisor."""
    return STORE_ENV in (os.environ if env is None else env)


def connect_store(address: str, timeout: float) -> Any:
    """A client of the supervisor's TCPStore at ``host:port``."""
    # torch on first use: the supervisor imports this module without torch (start-up time)
    import torch.distributed as dist

    host, _, port = address.rpartition(":")
    return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout))


def _read_int(store: Any, key: str, default: int = 0) -> int:
    return int(store.get(key)) if store.check([key]) else default


def _raise_in_thread(thread_id: int, exc: type) -> None:
    """Schedule ``exc`` in another thread (delivered at its next Python instruction)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(exc))


#: the running worker's monitor, which ``report_progress`` and the progress watch talk to (None: not supervised)
_active_monitor: Optional["WorkerMonitor"] = None


def start_progress_watch() -> None:
    """The training loop starts: from now on only its reported progress counts (``soft_timeout``, ``hard_timeout``)."""
    if _active_monitor is not None:
        _active_monitor.watch_progress(True)


def end_progress_watch() -> None:
    """The training loop ended: the monitor thread's own liveness counts as progress again."""
    if _active_monitor is not None:
        _active_monitor.watch_progress(False)


def report_progress() -> None:
    """The training loop finished an iteration, an evaluation step or a checkpoint save (nvrx's ``ping``)."""
    if _active_monitor is not None:
        _active_monitor.progress()


class WorkerMonitor:
    """This rank's monitor thread: heartbeat and progress timestamps in the store, the generation watch and the
    soft timeout.

    The main thread marks the span in which it may be interrupted (``running(generation)`` ... ``stopped()``); the
    thread raises RestartAbort there only, under a lock, so an interruption never lands in the teardown."""

    def __init__(self, address: str, rank: int, ipr: Any) -> None:
        self.address = address
        self.slot = rank  # the process's keys in the store
        self.rank = rank  # the workload rank it runs (a promoted reserve's changes), for the log
        self.ipr = ipr
        self._lock = threading.Lock()
        self._running_generation: Optional[int] = None
        # (monotonic, wall-clock) time of the training loop's last progress; None while the loop does not run
        self._last_progress: Optional[tuple[float, float]] = None
        self._main_thread_id = threading.main_thread().ident
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="longspan-inprocess-monitor", daemon=True)

    def start(self) -> None:
        global _active_monitor
        _active_monitor = self
        self._thread.start()

    def stop(self) -> None:
        global _active_monitor
        if _active_monitor is self:
            _active_monitor = None
        self._stop.set()

    def watch_progress(self, on: bool) -> None:
        self._last_progress = (time.monotonic(), time.time()) if on else None

    def progress(self) -> None:
        if self._last_progress is not None:
            self._last_progress = (time.monotonic(), time.time())

    def progress_stamp(self, now: float) -> float:
        """The progress timestamp for the store: the training loop's last progress while it runs, else ``now``."""
        last = self._last_progress
        return now if last is None else last[1]

    def running(self, generation: int) -> None:
        with self._lock:
            self._running_generation = generation
            self._last_progress = None

    def stopped(self) -> None:
        """Leave the interruptible span: no interruption is scheduled after this.

        Nothing is cancelled with ``PyThreadState_SetAsyncExc(tid, NULL)``: CPython then leaves the interpreter's
        eval breaker set for good, and with the torch profiler's Python tracer (``with_stack``) every later
        Python step crawls (a profiled run of the next training hung). An interruption already scheduled is
        delivered and caught where ``_attempt`` expects it."""
        with self._lock:
            self._running_generation = None
            self._last_progress = None

    def _loop(self) -> None:
        store = connect_store(self.address, self.ipr.barrier_timeout)
        ipr = self.ipr
        next_beat = next_progress = next_check = 0.0
        while not self._stop.is_set():
            now = time.time()
            try:
                if now >= next_beat:
                    store.set(heartbeat_key(self.slot), repr(now))
                    next_beat = now + ipr.heartbeat_interval
                if now >= next_progress:
                    store.set(progress_key(self.slot), repr(self.progress_stamp(now)))
                    next_progress = now + ipr.progress_watchdog_interval
                if now >= next_check:
                    self._check_generation(_read_int(store, GENERATION_KEY))
                    self._check_soft_timeout(store)
                    next_check = now + ipr.monitor_thread_interval
            except Exception:  # noqa: BLE001 - the supervisor is gone: the process is about to be ended
                return
            self._stop.wait(max(0.0, min(next_beat, next_progress, next_check) - time.time()))

    def _check_generation(self, generation: int) -> None:
        with self._lock:
            if self._running_generation is not None and generation > self._running_generation:
                logger.warning(f"in-process restart: rank {self.rank} interrupted: the job moved to generation "
                               f"{generation} while this rank ran generation {self._running_generation}")
                _raise_in_thread(self._main_thread_id, RestartAbort)
                self._running_generation = None  # once

    def _check_soft_timeout(self, store: Any) -> None:
        """No progress for soft_timeout seconds: record it, move the job to the next generation (every rank restarts
        in place; one bump however many ranks time out together) and interrupt the main thread. The progress stamp
        stays at the last progress until the interruption lands, so hard_timeout still ends a rank it cannot reach."""
        last = self._last_progress
        if last is None or time.monotonic() - last[0] < self.ipr.soft_timeout:
            return
        with self._lock:
            generation = self._running_generation
            if generation is None or self._last_progress is not last:
                return
            stalled = time.monotonic() - last[0]
            logger.warning(f"in-process restart: rank {self.rank} made no progress for {stalled:.1f} s "
                           f"(inprocess_restart.soft_timeout={self.ipr.soft_timeout:g}): interrupting it; every rank "
                           f"restarts in place in generation {generation + 1}")
            store.set(soft_timeout_key(self.slot), f"{generation}:{stalled:.3f}")
            store.compare_set(GENERATION_KEY, str(generation), str(generation + 1))
            _raise_in_thread(self._main_thread_id, RestartAbort)
            self._running_generation = None  # once


def rendezvous(store: Any, generation: int, rank: int, world_size: int, timeout: float) -> int:
    """Arrive at ``generation``'s barrier (or a newer one if the job has moved on); return the generation every rank
    reached. LaunchError after ``timeout`` seconds (inprocess_restart.barrier_timeout) or when the job is ending."""
    deadline = time.time() + timeout
    arrived_in: Optional[int] = None
    while True:
        if arrived_in == generation and int(store.add(arrived_key(generation), 0)) >= world_size:
            return generation
        newest = _read_int(store, GENERATION_KEY, generation)
        if newest > generation:
            generation = newest
        if arrived_in != generation:
            store.add(arrived_key(generation), 1)
            arrived_in = generation
            continue
        if store.check([FINISHING_KEY]):
            raise LaunchError(f"in-process restart: rank {rank}: the job is ending (another rank exited) while this "
                              f"rank waited to restart in generation {generation}")
        if time.time() > deadline:
            count = int(store.add(arrived_key(generation), 0))
            raise LaunchError(
                f"in-process restart: rank {rank} waited {timeout:g} s at the re-rendezvous of generation "
                f"{generation}: {count}/{world_size} ranks arrived (inprocess_restart.barrier_timeout)"
            )
        time.sleep(0.01)


def wait_for_rank(store: Any, generation: int, slot: int) -> Optional[tuple[int, int]]:
    """(generation, rank) for worker process ``slot``: its rank in the newest generation, or — a warm reserve — the
    first generation that gives it a failed rank's place; None when the job ends first."""
    waiting = False
    while True:
        generation = max(generation, _read_int(store, GENERATION_KEY, generation))
        rank = _read_int(store, assignment_key(generation, slot), slot)
        if rank >= 0:
            if waiting:
                logger.warning(f"in-process restart: reserve process {slot} (pid {os.getpid()}) takes rank {rank} in "
                               f"generation {generation}")
            return generation, rank
        if store.check([FINISHING_KEY]):
            return None
        waiting = True
        time.sleep(0.02)


def wait_for_next_generation(store: Any, generation: int, timeout: float) -> Optional[int]:
    """The job's generation once it is newer than ``generation``; None when the job is ending or after ``timeout``."""
    deadline = time.time() + timeout
    while True:
        newest = _read_int(store, GENERATION_KEY, generation)
        if newest > generation:
            return newest
        if store.check([FINISHING_KEY]) or time.time() > deadline:
            return None
        time.sleep(0.01)


def _is_peer_failure(exc: BaseException) -> bool:
    """Errors a peer's failure causes here: a collective or store operation that lost its peer."""
    # torch on first use: the supervisor imports this module without torch (start-up time)
    import torch.distributed as dist

    if isinstance(exc, (RestartAbort, dist.DistError, ConnectionError, TimeoutError)):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        s in text for s in ("gloo", "Connection reset", "Connection closed", "Broken pipe", "NCCL"))


def init_process_group(store: Any, generation: int, rank: int, world_size: int, timeout_minutes: float) -> None:
    """This generation's default process group, on its own key space of the supervisor's store."""
    # torch on first use: the supervisor imports this module without torch (start-up time)
    import torch
    import torch.distributed as dist  # (same reason)

    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, store=dist.PrefixStore(f"gen{generation}/pg", store), rank=rank,
                            world_size=world_size, timeout=timedelta(minutes=timeout_minutes))


#: how long a restarting worker waits for a background save of the failed run to end
_ASYNC_SAVE_GRACE_S = 30.0


def reset_process_state(empty_cuda_cache: bool) -> None:
    """Forget everything one training run left in the process: process groups and longspan's parallel state,
    compiled graphs, the CUDA cache (``empty_cuda_cache``), then collect garbage."""
    # torch on first use: the supervisor imports this module without torch (start-up time)
    import torch

    from longspan.training.checkpointing.async_save import abandon_in_flight_saves  # imports torch (as above)

    # A background save of the failed run still uses the checkpoint group: let it end before the groups go.
    running = abandon_in_flight_saves(timeout=_ASYNC_SAVE_GRACE_S)
    if running:
        logger.warning(f"in-process restart: {running} background checkpoint save(s) still running after "
                       f"{_ASYNC_SAVE_GRACE_S:.0f} s; their partial directories are ignored")
    try:
        destroy_distributed()
    except Exception as exc:  # noqa: BLE001 - a group whose peer died may fail to shut down cleanly
        logger.warning(f"in-process restart: destroying the process group failed ({exc}); continuing")
        # torch on first use: the supervisor imports this module without torch (start-up time)
        import torch.distributed as dist

        dist.distributed_c10d._world.pg_map.clear()  # noqa: SLF001 - make sure init_process_group can run again
        dist.distributed_c10d.GroupMember.WORLD = None
    if "torch._dynamo" in sys.modules:
        torch._dynamo.reset()
    if empty_cuda_cache and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    gc.collect()


def _attempt(monitor: WorkerMonitor, generation: int, train: Callable[[Any], int],
             cfg: Any) -> tuple[Optional[int], Optional[BaseException]]:
    """Run ``train(cfg)`` interruptibly: (exit code, None) or (None, the exception that ended it)."""
    try:
        try:
            monitor.running(generation)
            code = train(cfg)
            monitor.stopped()
            return code, None
        except BaseException as exc:  # noqa: BLE001 - the caller decides whether this rank restarts
            monitor.stopped()
            return None, exc
    except RestartAbort as exc:  # delivered inside the handler above, just before it left the interruptible span
        monitor.stopped()
        return None, exc


def _release_frames(exc: BaseException) -> None:
    """Let go of what the failed attempt's frames hold (its model, its process groups) so the teardown frees the
    groups: that closes their sockets, and a peer blocked in a collective with this rank fails at once instead of
    waiting for its own timeout."""
    seen: set[int] = set()
    pending: list[Optional[BaseException]] = [exc]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if current.__traceback__ is not None:
            traceback.clear_frames(current.__traceback__)
            current.__traceback__ = None
        pending += [current.__context__, current.__cause__]


def _exit_code_of(exc: BaseException) -> int:
    if isinstance(exc, SystemExit):
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 2 if isinstance(exc, LongspanError) else 1  # the CLI turns longspan's own errors into exit code 2


def run_worker(train: Callable[[Any], int], make_config: Callable[[], Any],
               env: Optional[Mapping[str, str]] = None) -> int:
    """Train with in-process restarts; return the training's exit code.

    ``make_config()`` builds a fresh ConfigContainer for each attempt (validation mutates it); ``train(cfg)`` runs
    one training attempt and returns its exit code (0, or the rerun machine's 16/17)."""
    env = os.environ if env is None else env
    cfg = make_config()
    ipr = cfg.inprocess_restart
    slot, world_size = int(env.get(SLOT_ENV, env["RANK"])), int(env["WORLD_SIZE"])
    address = env[STORE_ENV]
    generation = int(env.get(GENERATION_ENV, "0"))
    started_in = generation
    store = connect_store(address, ipr.barrier_timeout)
    monitor = WorkerMonitor(address, slot, ipr)  # its stamps are this process's, whichever rank it runs
    monitor.start()
    timeout_minutes = float(cfg.dist.distributed_timeout_minutes)
    # a peer's death surfaces within one supervisor check plus its wait for concurrent faults and its kill
    peer_grace = ipr.monitor_process_interval + ipr.last_call_wait + ipr.termination_grace_time + 5.0
    exit_code = 1
    try:
        while True:
            taken = wait_for_rank(store, generation, slot)
            if taken is None:  # a warm reserve the job never needed
                exit_code = 0
                return exit_code
            generation, rank = taken
            monitor.rank = rank
            if env is os.environ:  # logging and set-up read the rank from the environment, as under torchrun
                os.environ["RANK"] = os.environ["LOCAL_RANK"] = str(rank)
            began = time.time()
            generation = rendezvous(store, generation, rank, world_size, ipr.barrier_timeout)
            if generation != started_in:
                logger.warning(f"in-process restart: rank {rank} (pid {os.getpid()}) rejoined in generation "
                               f"{generation} after {time.time() - began:.2f} s; resuming from the newest checkpoint")
            if world_size > 1:
                init_process_group(store, generation, rank, world_size, timeout_minutes)
            try:
                code, exc = _attempt(monitor, generation, train, cfg)
                if exc is None:
                    exit_code = code
                    return exit_code
                exit_code = _exit_code_of(exc)
                if isinstance(exc, (SystemExit, KeyboardInterrupt)):
                    raise exc
                wait = ipr.barrier_timeout if _is_peer_failure(exc) else peer_grace
                newer = wait_for_next_generation(store, generation, wait)
                if newer is None:
                    raise exc
                logger.warning(f"in-process restart: rank {rank} (pid {os.getpid()}) stops generation {generation} "
                               f"({type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}); "
                               f"restarting in generation {newer}")
                generation = newer
                _release_frames(exc)
            finally:
                reset_process_state(ipr.empty_cuda_cache)
            cfg = make_config()
    finally:
        try:  # the interpreter's own shutdown may take a while: not a hang
            store.set(exiting_key(slot), str(exit_code))
        except Exception:  # noqa: BLE001 - the supervisor is gone
            pass
        monitor.stop()
