"""Launch detection (pure functions over env dicts), single-process init, user-error reporting."""

from __future__ import annotations

import io
import logging
import pytest

from longspan.config.schema.infra import DistributedInitConfig
from longspan.core.errors import ConfigError, LaunchError
from longspan.core.model_parallel_config import ModelParallelConfig
from longspan.parallel.init import (
    LaunchEnv,
    destroy_distributed,
    detect_launch,
    first_host_of_nodelist,
    get_parallel_state,
    initialize_distributed,
    report_user_error_once,
    slurm_master_port,
)


def DistCfg(**fields: object) -> DistributedInitConfig:  # noqa: N802 - reads as the config it builds
    """The ``dist`` section initialize_distributed reads, with a one-minute timeout and local rank 0."""
    return DistributedInitConfig(**{"distributed_timeout_minutes": 1, "local_rank": 0, **fields})


def MPCfg(**fields: object) -> ModelParallelConfig:  # noqa: N802 - reads as the config it builds
    """The model's parallel sizes initialize_distributed reads."""
    return ModelParallelConfig(**fields)


# --------------------------------------------------------------------------- detection


def test_torchrun_env():
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400",
           "SLURM_PROCID": "0", "SLURM_NTASKS": "2"}  # torchrun inside an sbatch script: torchrun wins
    assert detect_launch(env) == LaunchEnv("torchrun", 3, 4, 1, "10.0.0.1", 29400)


def test_torchrun_world_one_is_single():
    assert detect_launch({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}).kind == "single"


def test_no_launcher_is_single():
    assert detect_launch({}) == LaunchEnv("single", 0, 1, 0)


def test_bad_rank_env():
    with pytest.raises(LaunchError, match="RANK=4"):
        detect_launch({"RANK": "4", "WORLD_SIZE": "4"})
    with pytest.raises(LaunchError, match="WORLD_SIZE='x'"):
        detect_launch({"RANK": "0", "WORLD_SIZE": "x"})


def test_slurm_env_with_nodelist_and_job_port():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_JOB_ID": "1234567",
           "SLURM_NODELIST": "gpu[07-10]", "SLURM_LAUNCH_NODE_IPADDR": "10.1.1.1"}
    got = detect_launch(env, hostnames_fn=lambda nodes: None)  # no scontrol: parse the node list
    assert got == LaunchEnv("slurm", 5, 8, 1, "gpu07", 15000 + 4567)


def test_slurm_uses_scontrol_answer_and_explicit_master():
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_NODELIST": "n[1-2]", "SLURM_JOB_ID": "42"}
    assert detect_launch(env, hostnames_fn=lambda nodes: "n1.cluster").master_addr == "n1.cluster"
    env2 = dict(env, MASTER_ADDR="head", MASTER_PORT="1234")
    got = detect_launch(env2, hostnames_fn=lambda nodes: pytest.fail("must not be called"))
    assert (got.master_addr, got.master_port) == ("head", 1234)


def test_slurm_step_tasks_and_launch_ip_fallback():
    env = {"SLURM_PROCID": "1", "SLURM_NTASKS": "16", "SLURM_STEP_NUM_TASKS": "2",
           "SLURM_LAUNCH_NODE_IPADDR": "10.2.3.4"}
    got = detect_launch(env)
    assert (got.world_size, got.master_addr, got.master_port) == (2, "10.2.3.4", 29500)


def test_slurm_without_any_address_asks_for_master_addr():
    with pytest.raises(LaunchError, match="export MASTER_ADDR"):
        detect_launch({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"})


def test_slurm_single_task_is_single():
    assert detect_launch({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0"}).kind == "single"


@pytest.mark.parametrize("nodelist,first", [
    ("node1", "node1"), ("gpu[03-05,09],cpu1", "gpu03"), ("a1,b[2-3]", "a1"), ("rack[2]-n[4-5]", "rack2-n[4-5]"),
    ("x[001-004]y", "x001y"),
])
def test_first_host_of_nodelist(nodelist, first):
    assert first_host_of_nodelist(nodelist) == first


def test_slurm_master_port_formula():
    assert slurm_master_port("98765") == 15000 + 8765
    assert slurm_master_port("7") == 15007
    assert slurm_master_port(None) == 29500


# --------------------------------------------------------------------------- single process


def test_single_process_has_no_process_group():
    import torch.distributed as dist

    try:
        ps = initialize_distributed(DistCfg(distributed_backend="gloo"), MPCfg(), env={})
        assert not dist.is_initialized()
        assert ps.mesh is None and ps.world_size == 1 and ps.backend is None
        assert (ps.tp_size, ps.dp_size, ps.pp_size, ps.tp_rank, ps.dp_rank) == (1, 1, 1, 0, 0)
        assert ps.tp_group is None and ps.dp_group is None and ps.mp_group is None
        assert ps.is_last_rank and ps.is_pipeline_last_stage and ps.is_pipeline_first_stage
        assert ps.device.type == "cpu"
        assert get_parallel_state() is ps
    finally:
        destroy_distributed()
    with pytest.raises(RuntimeError):
        get_parallel_state()


def test_destroy_forgets_the_groups_made_in_the_dead_world():
    """Groups made on demand (the pipeline's embedding groups) belong to one world: after an in-process
    restart the cached ones would be the dead world's."""
    ps = initialize_distributed(DistCfg(distributed_backend="gloo"), MPCfg(), env={})
    ps.extra_groups[("embedding", 0, 1)] = object()
    destroy_distributed()
    assert ps.extra_groups == {}
    fresh = initialize_distributed(DistCfg(distributed_backend="gloo"), MPCfg(), env={})
    try:
        assert fresh.extra_groups == {}
    finally:
        destroy_distributed()


def test_single_process_layout_errors_still_raise():
    with pytest.raises(LaunchError, match="world size 1 is not divisible"):
        initialize_distributed(DistCfg(), MPCfg(tensor_model_parallel_size=2), env={})


def test_nccl_default_on_cpu_falls_back_to_gloo_silently(caplog):
    """nccl is the default: on a CPU machine it adapts without a warning (the banner says "device cpu")."""
    root = logging.getLogger("longspan")
    old = root.propagate
    root.propagate = True  # setup_logging turns propagation off; caplog listens at the root logger
    with caplog.at_level(logging.DEBUG, logger="longspan"):
        try:
            state = initialize_distributed(DistCfg(distributed_backend="nccl"), MPCfg(), env={}, device="cpu")
        finally:
            destroy_distributed()
            root.propagate = old
    records = {id(r): r for r in caplog.records if "nccl" in r.getMessage()}
    assert state.device.type == "cpu"
    assert records and all(r.levelno < logging.WARNING for r in records.values()), [
        (r.levelname, r.getMessage()) for r in records.values()
    ]


def test_bad_backend_and_timeout():
    with pytest.raises(ConfigError, match="distributed_backend='mpi'"):
        initialize_distributed(DistCfg(distributed_backend="mpi"), MPCfg(), env={})
    with pytest.raises(ConfigError, match="distributed_timeout_minutes=0"):
        initialize_distributed(DistCfg(distributed_timeout_minutes=0), MPCfg(), env={})


def test_real_distributed_init_config_is_accepted():
    import longspan.training.config as config
    cfg = config.DistributedInitConfig(distributed_backend="gloo")
    try:
        ps = initialize_distributed(cfg, MPCfg(), env={})
        assert ps.world_size == 1
    finally:
        destroy_distributed()


# --------------------------------------------------------------------------- one error line per job


def test_report_user_error_once_rank0_prints(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    buf = io.StringIO()
    assert report_user_error_once(ConfigError("train.train_iters=-1 must be positive"), stream=buf) == 2
    assert buf.getvalue() == "longspan: error: train.train_iters=-1 must be positive\n"


def test_report_user_error_once_other_ranks_silent(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    buf = io.StringIO()
    assert report_user_error_once(ConfigError("bad"), stream=buf) == 2
    assert buf.getvalue() == ""
    assert report_user_error_once(ConfigError("bad"), all_ranks=True, stream=buf) == 2
    assert buf.getvalue() == "[rank 3] longspan: error: bad\n"


def test_collectives_are_noops_without_process_group():
    import torch.distributed as dist

    from longspan.parallel import collectives as C

    assert not dist.is_initialized()
    assert C.all_reduce_max(2.5) == 2.5 and C.all_reduce_sum(3) == 3.0
    assert C.logical_and(False) is False and C.logical_or(True) is True
    obj = object()
    assert C.broadcast_object(obj) is obj and C.all_gather_object(7) == [7] and C.barrier() is None
