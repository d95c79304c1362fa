"""Megatron-FSDP's ddp.data_parallel_sharding_strategy mapped onto longspan's data-parallel modes, and
ddp.num_distributed_optimizer_instances as hybrid sharding (replicas of a sharded optimizer)."""

from __future__ import annotations

import pytest

from longspan.recipes.loading import load_config
from longspan.core.errors import ConfigError
from longspan.parallel.data_parallel import data_parallel_mode
from tests.parallel.conftest import pool2  # noqa: F401 - the 2-process pool


def _tiny(*overrides: str):
    return load_config("tiny", [], list(overrides))


@pytest.mark.parametrize("strategy, mode", [
    ("no_shard", "ddp"), ("optim", "distributed_optimizer"), ("optim_grads", "distributed_optimizer"),
    ("optim_grads_params", "fsdp2"),
])
def test_sharding_strategy_picks_the_mode_that_shards_the_same_state(strategy: str, mode: str) -> None:
    cfg = _tiny(f"ddp.data_parallel_sharding_strategy={strategy}")
    cfg.validate(world_size=2)
    assert data_parallel_mode(cfg) == mode
    assert cfg.ddp.use_distributed_optimizer == (mode == "distributed_optimizer")


def test_sharding_strategy_that_contradicts_fsdp2_is_one_line() -> None:
    cfg = _tiny("ddp.data_parallel_sharding_strategy=optim", "dist.use_torch_fsdp2=true")
    with pytest.raises(ConfigError, match="data_parallel_sharding_strategy='optim' keeps the parameters whole"):
        cfg.validate(world_size=2)


@pytest.mark.parametrize("overrides, world, message", [
    (["ddp.num_distributed_optimizer_instances=2"], 2, "needs optimizer.use_distributed_optimizer=true"),
    (["ddp.num_distributed_optimizer_instances=4", "dist.use_torch_fsdp2=true"], 6, "does not divide the data-parallel size 6"),
    (["ddp.num_distributed_optimizer_instances=2", "optimizer.use_distributed_optimizer=true",
      "model.context_parallel_size=2"], 4, "with model.context_parallel_size=2 is not supported yet"),
    (["ddp.num_distributed_optimizer_instances=2", "dist.use_torch_fsdp2=true"], 4, None),
])
def test_distributed_optimizer_instances_rules(overrides, world, message) -> None:
    cfg = _tiny(*overrides, "train.global_batch_size=null")
    if message is None:
        cfg.validate(world_size=world)
        return
    with pytest.raises(ConfigError, match=message):
        cfg.validate(world_size=world)


def _mesh_of_a_run(overrides: list[str]) -> tuple[int, int]:
    import time

    from longspan.training.setup import _initialize

    cfg = _tiny(*overrides, "dist.distributed_backend=gloo")
    cfg.validate(world_size=2)
    parallel = _initialize(cfg, time.time()).parallel
    return parallel.dp_replicate_size, parallel.dp_shard_size


@pytest.mark.slow
def test_instances_make_a_replicated_mesh_at_start_up(pool2) -> None:  # noqa: F811 - the pool fixture
    assert pool2.run(_mesh_of_a_run, ["ddp.num_distributed_optimizer_instances=2", "dist.use_torch_fsdp2=true"],
                     timeout=120) == [(2, 1), (2, 1)]


@pytest.mark.parametrize("switch", ["optimizer.overlap_param_gather", "ddp.overlap_param_gather"])
def test_overlap_param_gather_is_one_switch_on_optimizer_and_ddp(switch: str) -> None:
    cfg = _tiny(f"{switch}=true", "optimizer.use_distributed_optimizer=true", "ddp.overlap_grad_reduce=true")
    cfg.validate(world_size=2)
    assert cfg.optimizer.overlap_param_gather and cfg.ddp.overlap_param_gather


def test_fp8_param_gather_switches_on_the_float8_all_gather() -> None:
    cfg = _tiny("ddp.fp8_param_gather=true", "optimizer.use_distributed_optimizer=true")
    cfg.validate(world_size=2)
    assert cfg.model.fp8_param


@pytest.mark.parametrize("switch", ["ddp.use_megatron_fsdp", "ddp.use_custom_fsdp", "dist.use_megatron_fsdp"])
@pytest.mark.parametrize("strategy, mode", [
    ("no_shard", "distributed_optimizer"), ("optim_grads", "distributed_optimizer"), ("optim_grads_params", "fsdp2"),
])
def test_megatron_fsdp_runs_fsdp2_with_bridges_contract(switch: str, strategy: str, mode: str,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """FSDP2 in Megatron-FSDP's place: always the distributed optimizer, parameters sharded with
    'optim_grads_params'; dist.use_torch_fsdp2 stays as the user left it, so validate() twice is harmless."""
    cfg = _tiny(f"{switch}=true", f"ddp.data_parallel_sharding_strategy={strategy}")
    with caplog.at_level("INFO"):
        cfg.validate(world_size=2)
    assert data_parallel_mode(cfg) == mode
    assert cfg.optimizer.use_distributed_optimizer and cfg.ddp.use_distributed_optimizer
    assert not cfg.dist.use_torch_fsdp2
    notices = [r.getMessage() for r in caplog.records if "Megatron-FSDP's place" in r.getMessage()]
    assert len(notices) == 1 and notices[0].startswith(f"{switch}=True: PyTorch FSDP2 runs in Megatron-FSDP's place")
    assert cfg.ddp.use_megatron_fsdp and cfg.dist.use_megatron_fsdp  # Bridge sets both from either
    cfg.validate(world_size=2)


@pytest.mark.parametrize("overrides, message", [
    (["dist.use_torch_fsdp2=true"], "ddp.use_megatron_fsdp=True and dist.use_torch_fsdp2=True are mutually exclusive"),
    (["dist.use_tp_pp_dp_mapping=true"], "ddp.use_megatron_fsdp=True does not support dist.use_tp_pp_dp_mapping=True"),
    (["ddp.data_parallel_sharding_strategy=optim_grads_params", "train.check_weight_hash_across_dp_replicas_interval=5"],
     "'optim_grads_params' does not support train.check_weight_hash_across_dp_replicas_interval=5"),
])
def test_megatron_fsdp_conflicts_are_one_line(overrides: list[str], message: str) -> None:
    cfg = _tiny("ddp.use_megatron_fsdp=true", *overrides)
    with pytest.raises(ConfigError, match=message) as err:
        cfg.validate(world_size=2)
    assert "\n" not in str(err.value)
