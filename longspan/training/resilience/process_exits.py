"""When and how watched processes ended, as the kernel tells it (Linux pidfds), for the heartbeat monitor.

Which rank of a failed group is the root cause is a question of order: after a rank is killed from outside,
torch elastic notices at its next poll and stops the rest of the group with SIGTERM. A monitor that only looks
every few tens of milliseconds can find both gone in one look, and the beat times cannot tell them apart (a
rank that waited for its own async save beat last before the one that was killed). A pidfd becomes readable at
the moment its process exits, so a monitor waiting on them wakes at the first exit; for its own children it can
also read the end (signal or exit code) without reaping them (``WNOWAIT``: torch elastic still collects them).
A monitor thread can still be late on a busy machine: by the time it runs, torch elastic may have reaped the
killed rank and stopped the rest, and every end looks alike. So the launcher also calls ``collect`` from a
SIGCHLD handler (``longspan.training.resilience.launch``): it runs in torch elastic's own thread as soon as a
child ends, before that thread goes on to reap it and stop the others.
Where pidfds are not available (non-Linux, old kernels) nothing is recorded and ``wait`` only sleeps.
"""

from __future__ import annotations

import os
import select
import signal
import threading
import time
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class ProcessEnd:
    """A watched process's end: when it was seen (epoch seconds) and the signal that ended it, when known."""

    seen_at: float
    signal: Optional[int] = None


class ProcessExits:
    """Watches pids; ``wait`` returns early when one of them ends and records when (and, for children, how);
    ``collect`` records the ends so far without waiting. The first record of an end is kept."""

    def __init__(self) -> None:
        self._fds: dict[int, int] = {}
        self._poller = select.poll()
        # ``collect`` runs in another thread (a signal handler's), maybe again inside itself: reentrant
        self._lock = threading.RLock()
        self.ended: dict[int, ProcessEnd] = {}
        self.available = hasattr(os, "pidfd_open")

    def watch(self, pid: int) -> None:
        with self._lock:
            if not self.available or pid in self._fds or pid in self.ended:
                return
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                self.ended[pid] = ProcessEnd(time.time())
                return
            except OSError:  # pidfds not supported by this kernel
                self.available = False
                return
            self._fds[pid] = fd
            self._poller.register(fd, select.POLLIN)

    def wait(self, timeout: float) -> None:
        """Sleep up to ``timeout`` seconds, less when a watched process ends; record each end seen."""
        if not self._fds:
            time.sleep(timeout)
            return
        ready = {fd for fd, _ in self._poller.poll(timeout * 1000)}
        with self._lock:
            now = time.time()
            for pid, fd in list(self._fds.items()):
                if fd in ready:
                    if pid not in self.ended:
                        self.ended[pid] = ProcessEnd(now, _ending_signal(fd))
                    self._poller.unregister(fd)
                    os.close(fd)
                    del self._fds[pid]

    def collect(self) -> None:
        """Record the ends of watched processes that have ended by now (without waiting, and leaving their
        pidfds to ``wait``, which may be polling them in another thread)."""
        with self._lock:
            pending = {fd: pid for pid, fd in self._fds.items() if pid not in self.ended}
            if not pending:
                return
            poller = select.poll()  # its own: a poll object cannot be polled by two threads at once
            for fd in pending:
                poller.register(fd, select.POLLIN)
            now = time.time()
            for fd, _ in poller.poll(0):
                self.ended.setdefault(pending[fd], ProcessEnd(now, _ending_signal(fd)))

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


def _ending_signal(pidfd: int) -> Optional[int]:
    """The signal that ended a child that has not been reaped yet; None for an exit, a reaped child or a
    process that is not this one's child."""
    try:
        result = os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOWAIT | os.WNOHANG)
    except (ChildProcessError, OSError, AttributeError):
        return None
    if result is None or result.si_code not in (os.CLD_KILLED, os.CLD_DUMPED):
        return None
    return signal.Signals(result.si_status).value
