"""When and how watched processes ended, as the kernel tells it (Linux pidfds), for the heartbeat monitor.

Which rank of a failed group is the root cause is a question of order: after a rank is killed from outside,
torch elastic notices at its next poll and stops the rest of the group with SIGTERM. A monitor that only looks
every few tens of milliseconds can find both gone in one look, and the beat times cannot tell them apart (a
rank that waited for its own async save beat last before the one that was killed). A pidfd becomes readable at
the moment its process exits, so a monitor waiting on them wakes at the first exit; for its own children it can
also read the end (signal or exit code) without reaping them (``WNOWAIT``: torch elastic still collects them).
Where pidfds are not available (non-Linux, old kernels) nothing is recorded and ``wait`` only sleeps.
"""

from __future__ import annotations

import os
import select
import signal
import time
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class ProcessEnd:
    """A watched process's end: when it was seen (epoch seconds) and the signal that ended it, when known."""

    seen_at: float
    signal: Optional[int] = None


class ProcessExits:
    """Watches pids; ``wait`` returns early when one of them ends and records when (and, for children, how)."""

    def __init__(self) -> None:
        self._fds: dict[int, int] = {}
        self._poller = select.poll()
        self.ended: dict[int, ProcessEnd] = {}
        self.available = hasattr(os, "pidfd_open")

    def watch(self, pid: int) -> None:
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
        now = time.time()
        for pid, fd in list(self._fds.items()):
            if fd in ready:
                self.ended[pid] = ProcessEnd(now, _ending_signal(fd))
                self._poller.unregister(fd)
                os.close(fd)
                del self._fds[pid]

    def close(self) -> None:
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
