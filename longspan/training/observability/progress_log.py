"""``{checkpoint.save}/progress.txt``: Megatron's job progress log (``logger.log_progress``).

Each line is ``{%Y-%m-%d %H:%M:%S}\\tJob ID: {SLURM_JOB_ID}\\t# GPUs: {world size}\\t{message}``; the
messages are ``Starting job`` and ``Saved checkpoint\\tIteration: ...`` (see
``format_saved_checkpoint_message``), and the trainer's ``get_start_time_from_progress_log`` and
``compute_throughputs_and_append_to_progress_log`` built on them.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Optional

import torch.distributed as dist

from longspan.core.logging import get_rank, get_world_size
from longspan.training.state import GlobalState

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


def get_start_time_from_progress_log(cfg: Any) -> tuple[datetime, float]:
    """Start time of the earliest job with this world size, and the FLOPs of the last saved checkpoint.

    Walks ``progress.txt``: a ``Starting job`` line with a new world size restarts the window; the FLOPs at
    that point are subtracted when computing the cumulative throughput.
    """
    start_time = None
    start_num_flops = -1.0
    latest_num_flops = 0.0
    world_size = None
    for entry in parse_progress_log(cfg.checkpoint.save):
        if entry.message == STARTING_JOB:
            if entry.num_gpus != world_size:
                world_size = entry.num_gpus
                start_time = entry.timestamp
                start_num_flops = latest_num_flops
        elif "Floating-point operations" in entry.fields:
            latest_num_flops = float(entry.fields["Floating-point operations"])
    if start_time is None:
        raise ValueError(f"{cfg.checkpoint.save}/progress.txt has no '{STARTING_JOB}' line")
    return start_time, max(start_num_flops, 0.0)


def compute_throughputs_and_append_to_progress_log(state: GlobalState, num_floating_point_operations_so_far: float) -> None:
    """Append job and cumulative TFLOP/s/GPU, FLOPs and tokens to ``{save}/progress.txt``."""
    cfg = state.cfg
    if not cfg.checkpoint.save:
        return
    world_size = state.parallel.world_size
    job_flops = num_floating_point_operations_so_far - state.train_state_at_start_flops
    job_tput = job_flops / max(time.time() - state.start_time, 1e-9) / world_size / 1e12
    start_time, start_flops = get_start_time_from_progress_log(cfg)
    cumulative_seconds = max((datetime.now() - start_time).total_seconds(), 1e-9)
    cumulative_tput = (num_floating_point_operations_so_far - start_flops) / cumulative_seconds / world_size / 1e12
    tokens = state.train_state.consumed_train_samples * cfg.model.seq_length
    append_to_progress_log(
        cfg.checkpoint.save,
        format_saved_checkpoint_message(
            state.train_state.step, job_tput, cumulative_tput, num_floating_point_operations_so_far, tokens
        ),
    )
