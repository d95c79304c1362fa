"""dist.lazy_init: initialize_megatron sets up the run but the process groups, and hands back the finisher that
creates them (Megatron's lazy_mpu_init, for an external launcher or DDP manager)."""

from __future__ import annotations

import time

import pytest
import torch

from longspan.core.errors import ConfigError
from longspan.parallel import init as parallel_init
from longspan.recipes.loading import load_config
from longspan.training.initialize import initialize_megatron


@pytest.fixture(autouse=True)
def _no_groups_before() -> None:
    """These tests look at what exists before the finisher runs: start each from no process groups, whatever an
    earlier test in this worker process left behind."""
    parallel_init.destroy_distributed()


def _lazy_cfg():
    return load_config("tiny", [], ["dist.lazy_init=true", "dist.distributed_backend=gloo",
                                    "dist.distributed_timeout_minutes=1", "rng.seed=1234"])


def test_the_finisher_creates_the_state_and_seeds_one_process() -> None:
    finish = initialize_megatron(_lazy_cfg())
    try:
        assert callable(finish) and not parallel_init.is_initialized()
        torch.manual_seed(0)
        parallel = finish()
        assert parallel_init.get_parallel_state() is parallel and parallel.world_size == 1
        assert torch.initial_seed() == 1234  # the seed path runs with the groups
        assert finish() is parallel
    finally:
        parallel_init.destroy_distributed()


def test_without_lazy_init_the_groups_exist_at_once() -> None:
    cfg = _lazy_cfg()
    cfg.dist.lazy_init = False
    try:
        assert initialize_megatron(cfg) is parallel_init.get_parallel_state()
    finally:
        parallel_init.destroy_distributed()


def test_validate_initializes_on_the_cpu_and_pretrain_says_what_to_do() -> None:
    cfg = _lazy_cfg()
    cfg.validate(world_size=1)
    assert cfg.model.use_cpu_initialization
    from longspan.training.setup import _initialize

    with pytest.raises(ConfigError, match="dist.lazy_init=True defers the process groups") as err:
        _initialize(cfg, time.time())
    assert "\n" not in str(err.value) and not parallel_init.is_initialized()


def _lazy_on_two_ranks(external: bool) -> dict:
    import torch.distributed as dist

    from tests.parallel.harness import init_gloo

    finish = initialize_megatron(_lazy_cfg())
    before = dist.is_initialized() or parallel_init.is_initialized()
    if external:  # the external manager creates the default group; the finisher adopts it
        init_gloo(timeout_s=60)
    parallel = finish()
    total = torch.tensor([float(parallel.rank + 1)])
    dist.all_reduce(total, group=parallel.dp_group)
    return {"before": before, "world": dist.get_world_size(), "dp": parallel.dp_size, "sum": float(total),
            "same": finish() is parallel}


@pytest.mark.parametrize("external", [False, True], ids=["finisher_creates", "manager_creates"])
def test_process_groups_wait_for_the_finisher_on_two_ranks(pool2, external: bool) -> None:
    for rank in pool2.run(_lazy_on_two_ranks, external, timeout=120):
        assert rank == {"before": False, "world": 2, "dp": 2, "sum": 3.0, "same": True}
