"""Replicated local non-persistent checkpoints (checkpoint.replication): a 2-rank run saves locally every 2
iterations with each rank's file replicated to its peer, crashes in iteration 6, and then rank 1 loses its whole
node-local directory (its own file and its replica of rank 0). The same command again restores rank 1's file from
rank 0's replica, resumes from iteration 4, and iteration 5 comes out bit for bit as before the crash (dropout on:
model, optimizer, RNG and data position all restored)."""

from __future__ import annotations

import pytest

from tests.helpers.layout_parity import logged
from tests.parallel.test_layout_parity import pretrain_config

ITERS = 6


def _lose_one_rank_and_resume(root: str) -> tuple[dict, list, list]:
    import os
    import shutil

    from longspan.training.checkpointing.non_persistent import local_iterations, local_rank_dir
    from longspan.training.pretrain import pretrain
    from longspan.training.step.forward_step import forward_step

    def config(name: str):
        cfg = pretrain_config(f"{root}/{name}", iters=ITERS)
        cfg.train.global_batch_size = 4
        cfg.model.hidden_dropout = cfg.model.attention_dropout = 0.1
        return cfg

    cfg = config("np")
    cfg.checkpoint.non_persistent_ckpt_type = "local"
    cfg.checkpoint.non_persistent_save_interval = 2
    cfg.checkpoint.non_persistent_local_ckpt_dir = f"{root}/node_local"
    cfg.checkpoint.replication = True
    cfg.checkpoint.replication_jump = 1
    cfg.checkpoint.replication_factor = 2

    def crashing_forward_step(state, data_iterator, model, return_schedule_plan=False):
        if state.train_state.step == 5:
            raise RuntimeError("simulated crash in iteration 6")
        return forward_step(state, data_iterator, model)

    with pytest.raises(RuntimeError, match="simulated crash"):
        pretrain(cfg, crashing_forward_step)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    rank_dir = local_rank_dir(cfg.checkpoint, rank, world)
    held = sorted(p.relative_to(rank_dir).as_posix() for p in rank_dir.rglob("*.pt"))
    if rank == 1:
        shutil.rmtree(rank_dir)  # the node of rank 1 lost its local storage
    pretrain(cfg)  # the same command again
    restored = local_iterations(cfg.checkpoint) if rank == 1 else None
    return logged(f"{root}/np"), held, restored


@pytest.mark.slow
def test_lost_local_checkpoint_comes_back_from_its_replica(pool2, tmp_path) -> None:
    (got, held0, _), (_, held1, restored1) = pool2.run(_lose_one_rank_and_resume, str(tmp_path), timeout=300)
    assert held0 == ["iter_0000004.pt", "replica_of_rank1/iter_0000004.pt"]  # the saves of 2 cleaned up
    assert held1 == ["iter_0000004.pt", "replica_of_rank0/iter_0000004.pt"]
    assert restored1 == [6]  # iteration 4 came back from rank 0, and the finished run saved 6
    assert got["iterations"] == [1, 2, 3, 4, 5, 5, 6]  # resumed from 4: iteration 5 ran again
    assert got["losses"][5] == got["losses"][4] and got["norms"][5] == got["norms"][4]  # bit-exact, dropout on


def test_cliques_follow_jump_and_factor(monkeypatch) -> None:
    from types import SimpleNamespace

    from longspan.core.errors import ConfigError
    from longspan.training.checkpointing import replication

    monkeypatch.setattr(replication, "_world_size", lambda: 12)
    monkeypatch.setattr(replication, "_rank", lambda: 7)
    # jump 2, factor 3: blocks of 6 ranks; rank 7 is offset 1 in block 1, so its clique is 7, 9, 11
    assert replication._clique(SimpleNamespace(replication_jump=2, replication_factor=3)) == [7, 9, 11]
    assert replication._clique(SimpleNamespace(replication_jump=4, replication_factor=3)) == [3, 7, 11]
    assert replication._clique(SimpleNamespace(replication_jump=1, replication_factor=2)) == [6, 7]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "6")  # jump None: ranks per node, so replicas land on the other node
    assert replication._clique(SimpleNamespace(replication_jump=None, replication_factor=2)) == [1, 7]
    with pytest.raises(ConfigError, match="replication_jump=5 x checkpoint.replication_factor=2"):
        replication._clique(SimpleNamespace(replication_jump=5, replication_factor=2))
