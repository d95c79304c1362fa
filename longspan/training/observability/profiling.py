"""Profiling helpers for the training loop, driven by ``cfg.profiling`` (Megatron Bridge's ``ProfilingConfig``).

- torch.profiler: ``build_pytorch_profiler`` gives an unstarted profiler the loop starts at
  ``profile_step_start`` and stops at ``profile_step_end``; ``initialize_pytorch_profiler`` gives one with
  Megatron Bridge's wait/warmup/active schedule for loops that only call ``step()``.
- nsys: ``start_nsys_profiler`` / ``stop_nsys_profiler`` bracket the steps with cudaProfilerStart/Stop.
- CUDA memory history: ``start_memory_history_recording`` (in ``observability/memory.py``, re-exported here).

Only ranks listed in ``profile_ranks`` profile. Everything CUDA-specific is a logged no-op without CUDA.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import torch.profiler

from longspan.config.schema.container import ConfigContainer
from longspan.config.schema.infra import ProfilingConfig
from longspan.core.logging import get_logger, get_rank
from longspan.training.observability.memory import dump_memory_snapshot, start_memory_history_recording
from longspan.training.state import GlobalState

logger = get_logger(__name__)

TNvtxContext = torch.autograd.profiler.emit_nvtx

__all__ = [
    "TNvtxContext",
    "build_pytorch_profiler",
    "dump_memory_snapshot",
    "handle_profiling_step",
    "handle_profiling_stop",
    "initialize_pytorch_profiler",
    "profiler_trace_dir",
    "should_profile_rank",
    "start_memory_history_recording",
    "start_nsys_profiler",
    "stop_nsys_profiler",
]


def should_profile_rank(config: Optional[ProfilingConfig], rank: int) -> bool:
    """True when profiling is configured and ``rank`` is in ``config.profile_ranks``."""
    if config is None:
        return False
    return rank in list(config.profile_ranks or [])


def profiler_trace_dir(cfg: ConfigContainer) -> str:
    """Where torch.profiler traces go: ``logger.tensorboard_dir``, else ``{checkpoint.save}/profile``, else ./profile."""
    tb_dir = cfg.logger.tensorboard_dir if cfg.logger is not None else None
    if tb_dir:
        return tb_dir
    save = cfg.checkpoint.save if cfg.checkpoint is not None else None
    return os.path.join(save, "profile") if save else os.path.join(os.getcwd(), "profile")


def _activities() -> list[torch.profiler.ProfilerActivity]:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return activities


def build_pytorch_profiler(config: ProfilingConfig, state: GlobalState) -> Optional[torch.profiler.profile]:
    """An unstarted torch.profiler for this rank, or None when this rank is not in ``profile_ranks``.

    It has no schedule: everything between ``start()`` (the loop calls it at ``profile_step_start``) and
    ``stop()`` (at ``profile_step_end``) is recorded, and the trace is written for TensorBoard's profiler
    plugin into ``profiler_trace_dir(state.cfg)``.
    """
    if not should_profile_rank(config, get_rank()):
        return None
    trace_dir = profiler_trace_dir(state.cfg)
    logger.info(
        f"torch.profiler on rank {get_rank()}: iterations {config.profile_step_start}-{config.profile_step_end}, "
        f"traces in {trace_dir}"
    )
    return torch.profiler.profile(
        activities=_activities(),
        on_trace_ready=torch.profiler.tensorboard_trace_handler(trace_dir),
        record_shapes=bool(config.record_shapes),
        with_stack=True,
    )


def initialize_pytorch_profiler(config: ProfilingConfig, tensorboard_dir: str) -> torch.profiler.profile:
    """An unstarted torch.profiler with a schedule: wait until ``profile_step_start - 1``, warm up one
    step, record ``profile_step_end - profile_step_start`` steps; call ``step()`` every iteration."""
    return torch.profiler.profile(
        activities=_activities(),
        schedule=torch.profiler.schedule(
            wait=max(config.profile_step_start - 1, 0),
            warmup=1 if config.profile_step_start > 0 else 0,
            active=config.profile_step_end - config.profile_step_start,
            repeat=1,
        ),
        on_trace_ready=torch.profiler.tensorboard_trace_handler(tensorboard_dir),
        record_shapes=bool(config.record_shapes),
        with_stack=True,
    )


def start_nsys_profiler(config: ProfilingConfig) -> Optional[TNvtxContext]:
    """Start CUDA profiling for an external nsys run and enter an NVTX context (None without CUDA)."""
    if not torch.cuda.is_available():
        logger.info("profiling.use_nsys_profiler is set but CUDA is not available: nsys profiling skipped")
        return None
    torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStart())
    context = torch.autograd.profiler.emit_nvtx(record_shapes=bool(config.record_shapes))
    context.__enter__()
    return context


def stop_nsys_profiler(nvtx_context: Optional[TNvtxContext]) -> None:
    """Stop CUDA profiling and leave the NVTX context returned by ``start_nsys_profiler``."""
    if not torch.cuda.is_available():
        return
    torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStop())
    if nvtx_context is not None:
        nvtx_context.__exit__(None, None, None)


def handle_profiling_step(
    config: Optional[ProfilingConfig], iteration: int, rank: int, pytorch_prof: Optional[torch.profiler.profile]
) -> Optional[TNvtxContext]:
    """Per-step profiling: step the torch profiler; start nsys at ``profile_step_start``.

    Returns the NVTX context when nsys profiling started at this step, else None.
    """
    if not should_profile_rank(config, rank):
        return None
    if config.use_pytorch_profiler and pytorch_prof is not None:
        pytorch_prof.step()
    if config.use_nsys_profiler and iteration == config.profile_step_start:
        return start_nsys_profiler(config)
    return None


def handle_profiling_stop(
    config: Optional[ProfilingConfig],
    iteration: int,
    rank: int,
    pytorch_prof: Optional[torch.profiler.profile],
    nsys_nvtx_context: Optional[TNvtxContext] = None,
) -> None:
    """At ``profile_step_end``: stop the torch profiler and nsys profiling (on profiled ranks)."""
    if not should_profile_rank(config, rank) or iteration != config.profile_step_end:
        return
    if config.use_pytorch_profiler and pytorch_prof is not None:
        pytorch_prof.stop()
    if config.use_nsys_profiler:
        stop_nsys_profiler(nsys_nvtx_context)
