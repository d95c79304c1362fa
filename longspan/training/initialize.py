"""Megatron Bridge's ``initialize_megatron``: logging, the process groups and the seeds, for code that drives its
own training loop (``pretrain``/``finetune`` initialize through ``setup``).

With ``dist.lazy_init`` (Megatron's ``lazy_mpu_init``) everything but the process groups is set up and the
function returning the rest is handed back: an external launcher or DDP manager calls it when it is ready (for
example after creating torch's default process group itself, which the finisher then adopts). Megatron also
initializes the weights on the CPU then; validate() turns ``model.use_cpu_initialization`` on for it.
"""

from __future__ import annotations

import random
from typing import Any, Callable, Union

import numpy as np
import torch

from longspan.core.logging import configure_log_filters, get_logger, print_rank_0, setup_logging
from longspan.parallel.init import ParallelState, prepare_distributed
from longspan.training.resilience.heartbeat import beat_before_distributed_init

logger = get_logger(__name__)


def start_logging(cfg: Any) -> None:
    """The run's log level and filters, and the first heartbeat before the process group forms (ft)."""
    setup_logging(cfg.logger.logging_level)
    lg = cfg.logger
    configure_log_filters(lg.logging_level, lg.filter_warnings, lg.modules_to_filter, lg.set_level_for_all_loggers)
    beat_before_distributed_init(cfg.ft)  # ft: this rank got as far as its set-up (the monitor's blame order)


def set_random_seed(seed: int, parallel: ParallelState, data_parallel_random_init: bool = False) -> int:
    """Seed python, numpy and torch like Megatron: seed + 100·pp_rank (+ 10·dp_rank when requested)."""
    seed = seed + 100 * parallel.pp_rank
    if data_parallel_random_init:
        seed = seed + 10 * parallel.dp_rank
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    return seed


def initialize_megatron(
    cfg: Any, *, skip_mpu_initialization: bool = False
) -> Union[ParallelState, Callable[[], ParallelState], None]:
    """Set up logging and this rank's launch, device and layout, then the process groups and the seeds.

    Returns the ParallelState (Bridge: the process-group collection); with ``cfg.dist.lazy_init`` the finisher
    that creates the groups, seeds the generators and returns that state instead; with
    ``skip_mpu_initialization`` None (no groups, no seeds: the caller owns both).
    """
    start_logging(cfg)
    finish_groups = prepare_distributed(cfg.dist, cfg.model, dp_replicate=cfg.ddp.num_distributed_optimizer_instances)

    def finish_mpu_init() -> ParallelState:
        parallel = finish_groups()
        print_rank_0(f"setting random seeds to {cfg.rng.seed}", logger)
        set_random_seed(cfg.rng.seed, parallel, cfg.rng.data_parallel_random_init)
        return parallel

    if skip_mpu_initialization:
        return None
    if cfg.dist.lazy_init:
        print_rank_0("dist.lazy_init: process groups are created when the returned function is called", logger)
        return finish_mpu_init
    return finish_mpu_init()

