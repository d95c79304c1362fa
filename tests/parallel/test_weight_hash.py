"""check_weight_hash_across_dp_replicas_interval: replicas agree during DDP training; a diverged one is caught."""

from __future__ import annotations

import pytest

from tests.parallel.harness import get_shared_pool

pytestmark = pytest.mark.slow


def _train_with_hash_checks_then_perturb(run_dir: str, tp: int, fsdp: bool = False) -> tuple[bool, bool]:
    from pathlib import Path

    import torch
    import torch.distributed as dist

    from longspan.training.step.forward_step import forward_step
    from longspan.training.pretrain import pretrain
    from longspan.parallel.replica_hash import check_param_hashes_across_dp_replicas, replicated_parameter_count
    from tests.training.pretrain_helpers import small_config

    seen = {}

    def capture(state, data_iterator, model):
        seen["model"] = model
        return forward_step(state, data_iterator, model)

    cfg = small_config(Path(run_dir), "run", train_iters=4, eval_interval=None,
                       check_weight_hash_across_dp_replicas_interval=2)
    cfg.model.tensor_model_parallel_size = tp
    cfg.dist.use_torch_fsdp2 = fsdp
    cfg.checkpoint.save = cfg.checkpoint.load = None
    cfg.logger.tensorboard_dir = None
    pretrain(cfg, capture)  # raises if the replicas disagree at iterations 2 and 4
    model = seen["model"]
    agree = check_param_hashes_across_dp_replicas([model])
    if replicated_parameter_count([model]) == 0:  # TP-only or fully sharded: nothing has a replica
        return agree, None
    # Perturb one TP shard (a DTensor's local piece when tp > 1) on the last rank only: its dp replica differs.
    name, param = next((n, p) for n, p in model.named_parameters() if "linear_qkv" in n or "linear_q" in n)
    if dist.get_rank() == dist.get_world_size() - 1:
        with torch.no_grad():
            (param.to_local() if hasattr(param, "to_local") else param).add_(1.0)
    caught = not check_param_hashes_across_dp_replicas([model])
    return agree, caught


def test_ddp_replicas_hash_equal_and_a_diverged_replica_is_caught(tmp_path) -> None:
    results = get_shared_pool(2).run(_train_with_hash_checks_then_perturb, str(tmp_path), 1, timeout=120)
    assert results == [(True, True), (True, True)]


def test_tensor_parallel_shards_are_not_mistaken_for_diverged_replicas(tmp_path) -> None:
    results = get_shared_pool(2).run(_train_with_hash_checks_then_perturb, str(tmp_path), 2, timeout=120)
    assert results == [(True, None), (True, None)]


def test_dp_by_tp_compares_each_tensor_parallel_shard_with_its_dp_replica(tmp_path) -> None:
    """DP2 x TP2: parameters are DTensors; each rank's local shard is hashed against its dp replica's."""
    results = get_shared_pool(4).run(_train_with_hash_checks_then_perturb, str(tmp_path), 2, timeout=180)
    # The perturbed rank (3) and its dp replica (1) disagree; the other pair (0, 2) still agrees.
    assert [r[0] for r in results] == [True] * 4
    assert [r[1] for r in results] == [False, True, False, True]


def test_fsdp2_shards_have_no_replica_to_compare(tmp_path) -> None:
    """FSDP2 shards linear_q over dp: each rank's piece has no replica, so changing one is no divergence (the
    check compares only what is replicated, here the embedding that FSDP2 leaves whole)."""
    results = get_shared_pool(2).run(_train_with_hash_checks_then_perturb, str(tmp_path), 1, True, timeout=120)
    assert results == [(True, False), (True, False)]
