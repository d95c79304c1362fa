"""check_weight_hash_across_dp_replicas_interval: replicas agree during DDP training; a diverged one is caught."""

from __future__ import annotations

import pytest

from tests.parallel.harness import get_shared_pool

pytestmark = pytest.mark.slow


def _train_with_hash_checks_then_perturb(run_dir: str, tp: int) -> tuple[bool, bool]:
    from pathlib import Path

    import torch
    import torch.distributed as dist

    from longspan.training.forward_step import forward_step
    from longspan.training.pretrain import pretrain
    from longspan.training.train import check_param_hashes_across_dp_replicas
    from tests.training.pretrain_helpers import small_config

    seen = {}

    def capture(state, data_iterator, model):
        seen["model"] = model
        return forward_step(state, data_iterator, model)

    cfg = small_config(Path(run_dir), "run", train_iters=4, eval_interval=None,
                       check_weight_hash_across_dp_replicas_interval=2)
    cfg.model.tensor_model_parallel_size = tp
    cfg.checkpoint.save = cfg.checkpoint.load = None
    cfg.logger.tensorboard_dir = None
    pretrain(cfg, capture)  # raises if the replicas disagree at iterations 2 and 4
    agree = check_param_hashes_across_dp_replicas([seen["model"]])
    if tp > 1:  # TP shards differ per rank by design and dp is 1: nothing to compare, nothing to flag
        return agree, None
    if dist.get_rank() == 1:
        with torch.no_grad():
            next(seen["model"].parameters()).add_(1.0)
    caught = not check_param_hashes_across_dp_replicas([seen["model"]])
    return agree, caught


def test_ddp_replicas_hash_equal_and_a_diverged_replica_is_caught(tmp_path) -> None:
    results = get_shared_pool(2).run(_train_with_hash_checks_then_perturb, str(tmp_path), 1, timeout=120)
    assert results == [(True, True), (True, True)]


def test_tensor_parallel_shards_are_not_mistaken_for_diverged_replicas(tmp_path) -> None:
    results = get_shared_pool(2).run(_train_with_hash_checks_then_perturb, str(tmp_path), 2, timeout=120)
    assert results == [(True, None), (True, None)]
