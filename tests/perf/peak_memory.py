"""Peak resident memory of a block of code in this process (Linux): VmHWM after resetting it.

Writing ``5`` to ``/proc/self/clear_refs`` resets the high-water mark to the current RSS, so
``peak_rss_delta(fn)`` is how far the resident set grew above where it stood when ``fn`` started. Large
torch CPU tensors are mmapped and returned to the OS on free, so this sees their lifetime.
"""

from __future__ import annotations

import gc
from typing import Any, Callable


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def peak_rss_delta(fn: Callable[[], Any]) -> tuple[int, Any]:
    """(bytes the peak RSS rose above the RSS at the start, fn's result)."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    start = _status_kib("VmRSS")
    result = fn()
    return (_status_kib("VmHWM") - start) * 1024, result
