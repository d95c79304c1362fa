"""``{checkpoint.save}/progress.txt``: Megatron's job progress log (``logger.log_progress``).

Each line is ``{%Y-%m-%d %H:%M:%S}\\tJob ID: {SLURM_JOB_ID}\\t# GPUs: {world size}\\t{message}``; the
messages are ``Starting job`` and ``Saved checkpoint\\tIteration: ...`` (see
``format_saved_checkpoint_message``). The trainer's ``get_start_time_from_progress_log`` and
``compute_throughputs_and_append_to_progress_log`` build on these helpers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import datetime
from typing import Optional

import torch.distributed as dist

from longspan.core.logging import get_rank, get_world_size

PROGRESS_FILENAME = "progress.txt"
TIME_FORMAT = "%Y-%m-%d %H:%M:%S"
STARTING_JOB = "Starting job"


def progress_log_path(save_dir: str) -> str:
    """Path of the progress log inside ``save_dir``."""
    return os.path.join(save_dir, PROGRESS_FILENAME)


def format_progress_line(message: str, world_size: int, job_id: Optional[str] = None, now: Optional[datetime] = None) -> str:
    """One progress-log line (with the trailing newline)."""
    job_id = os.environ.get("SLURM_JOB_ID", "") if job_id is None else job_id
    stamp = (now or datetime.now()).strftime(TIME_FORMAT)
    return f"{stamp}\tJob ID: {job_id}\t# GPUs: {world_size}\t{message}\n"


def append_to_progress_log(save_dir: Optional[str], string: str, barrier: bool = True) -> None:
    """Append ``string`` as a progress line to ``{save_dir}/progress.txt`` on rank 0.

    ``barrier`` first waits for every rank (so the line follows the work it reports). No-op when
    ``save_dir`` is None.
    """
    if save_dir is None:
        return
    if barrier and dist.is_available() and dist.is_initialized():
        dist.barrier()
    if get_rank() != 0:
        return
    os.makedirs(save_dir, exist_ok=True)
    with open(progress_log_path(save_dir), "a", encoding="utf-8") as f:
        f.write(format_progress_line(string, get_world_size()))


def format_saved_checkpoint_message(
    iteration: int,
    job_throughput: float,
    cumulative_throughput: float,
    floating_point_operations: float,
    tokens: float,
) -> str:
    """The ``Saved checkpoint`` message: throughputs in TFLOP/s/GPU, FLOPs so far, tokens so far."""
    return (
        f"Saved checkpoint\tIteration: {iteration}\t"
        f"Job throughput: {job_throughput:.1f} TFLOP/s/GPU\t"
        f"Cumulative throughput: {cumulative_throughput:.1f} TFLOP/s/GPU\t"
        f"Floating-point operations: {floating_point_operations:.2e}\t"
        f"Tokens (in billions): {tokens / 10**9:.2f}"
    )


@dataclass
class ProgressLogEntry:
    """One parsed progress-log line: when, which job, how many GPUs, the message and its ``key: value`` fields."""

    timestamp: datetime
    job_id: str
    num_gpus: int
    message: str
    fields: dict[str, str] = field(default_factory=dict)


def parse_progress_log(save_dir: str) -> list[ProgressLogEntry]:
    """Entries of ``{save_dir}/progress.txt`` in file order; [] when the file does not exist.

    For ``Saved checkpoint`` lines ``fields`` holds ``Iteration``, ``Job throughput``, ``Cumulative
    throughput``, ``Floating-point operations`` and ``Tokens (in billions)`` as written (strings).
    Malformed lines are skipped.
    """
    path = progress_log_path(save_dir)
    if not os.path.exists(path):
        return []
    entries: list[ProgressLogEntry] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            parts = line.rstrip("\n").split("\t")
            if len(parts) < 4 or not parts[1].startswith("Job ID:") or not parts[2].startswith("# GPUs:"):
                continue
            try:
                stamp = datetime.strptime(parts[0], TIME_FORMAT)
                num_gpus = int(parts[2][len("# GPUs:") :].strip())
            except ValueError:
                continue
            fields_: dict[str, str] = {}
            for extra in parts[4:]:
                key, _, value = extra.partition(":")
                fields_[key.strip()] = value.strip()
            entries.append(
                ProgressLogEntry(stamp, parts[1][len("Job ID:") :].strip(), num_gpus, parts[3], fields_)
            )
    return entries
