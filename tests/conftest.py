"""Session-wide test settings.

One intra-op thread per process: tests on a 2-core machine often run next to worker processes, and torch's
spinning OpenMP threads then slow tiny matmuls down by two orders of magnitude. Child processes inherit
OMP_NUM_THREADS.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

torch.set_num_threads(1)
