"""Progress of long loops (HF import/export, preprocessing): a bar redrawn in place on a terminal, plain lines
everywhere else.

A ``\\r`` frame only makes sense on a terminal: in a log file, a pipe or a CI log every frame stays, glued into
one endless line. So ``Progress`` asks its stream ``isatty()`` once: on a terminal it redraws one line at most
every ``refresh_s`` seconds and ends it with a newline; elsewhere it writes a whole line each time another
``every_percent`` of the work is done (10%, 20%, ... 100%), never a ``\\r``.

Every progress report of longspan goes through this class; callers decide which rank reports (``enabled``).
"""

from __future__ import annotations

import math
import sys
import time
from typing import TextIO


def is_terminal(stream: TextIO) -> bool:
    """Whether ``stream`` is an interactive terminal (False for files, pipes, captured or closed streams)."""
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty()) if callable(isatty) else False
    except (ValueError, OSError):  # a closed or detached stream
        return False


def _clock(seconds: float) -> str:
    if seconds != seconds or seconds == math.inf:
        return "--:--"
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}" if seconds >= 3600 else (
        f"{seconds // 60:02d}:{seconds % 60:02d}")


class Progress:
    """How far a loop over ``total`` units has got, written to ``stream`` (default: ``sys.stderr``).

    ``advance(n)`` or ``update(done)`` move it; ``detail`` replaces the default "done/total unit" text of a
    report (a caller's own counters: documents, tokens/s). ``close()`` ends the terminal line (call it on errors
    too: an error message then starts on its own line). With ``enabled=False`` nothing is written.
    """

    def __init__(self, total: int, desc: str, unit: str = "items", *, enabled: bool = True,
                 stream: TextIO | None = None, every_percent: float = 10.0, refresh_s: float = 0.2) -> None:
        self.total, self.desc, self.unit, self.enabled = max(0, int(total)), desc, unit, enabled
        self.stream = stream if stream is not None else sys.stderr
        self.terminal = is_terminal(self.stream)
        self.every_percent = float(every_percent)
        self.refresh_s = float(refresh_s)
        self.done = 0
        self.start = time.time()
        self._last_frame = -math.inf  # when the terminal line was last redrawn
        self._frame_width = 0  # length of the frame on screen (a shorter one is padded over it)
        self._next_percent = self.every_percent  # the plain-line mode's next report
        self._open_frame = False  # a terminal frame without its newline yet

    @property
    def percent(self) -> float:
        return 100.0 * min(self.done, self.total) / self.total if self.total else 100.0

    def advance(self, n: int = 1, detail: str | None = None) -> None:
        self.update(self.done + n, detail)

    def update(self, done: int, detail: str | None = None) -> None:
        """Set the units done so far."""
        self.done = int(done)
        if not self.enabled:
            return
        finished = self.total > 0 and self.done >= self.total
        if self.terminal:
            now = time.time()
            if finished or now - self._last_frame >= self.refresh_s:
                self._last_frame = now
                self._draw(self._text(detail))
        elif self.percent >= self._next_percent:
            self._next_percent = (math.floor(self.percent / self.every_percent) + 1) * self.every_percent
            self._write(self._text(detail) + "\n")

    def close(self, detail: str | None = None) -> None:
        """End the report: a terminal line gets its last frame and a newline; nothing more in plain-line mode
        (a loop that stopped early does not claim 100%), except for empty work, which is reported done."""
        if not self.enabled:
            return
        if self.terminal:
            if self._open_frame:
                self._draw(self._text(detail))
                self._write("\n")
                self._open_frame = False
        elif self.total == 0 and self._next_percent <= 100.0:
            self._next_percent = math.inf
            self._write(self._text(detail) + "\n")

    def _text(self, detail: str | None) -> str:
        elapsed = time.time() - self.start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        left = (self.total - self.done) / rate if rate > 0 else math.nan
        counts = detail if detail is not None else f"{self.done}/{self.total} {self.unit}"
        eta = "" if self.total and self.done >= self.total else f", ETA {_clock(max(0.0, left))}"
        return f"{self.desc} [{self.percent:5.1f}%] {counts} | {elapsed:.1f} s{eta}"

    def _draw(self, text: str) -> None:
        pad = " " * max(0, self._frame_width - len(text))
        self._frame_width = len(text)
        self._open_frame = True
        self._write(f"\r{text}{pad}")

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (ValueError, OSError):  # the stream went away (a closed pipe): progress is not worth an error
            self.enabled = False


__all__ = ["Progress", "is_terminal"]
