"""Lines a multi-process run prints once, where the user reads first (rank 0's console)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from longspan.training.observability.run_summary import print_nothing_to_train


@pytest.mark.parametrize("rank", [0, 1])
def test_a_finished_run_says_there_is_nothing_to_train_on_rank_0_only(rank, monkeypatch, captured):
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", "2")
    state = SimpleNamespace(cfg=SimpleNamespace(train=SimpleNamespace(train_iters=200)), start_iteration=200)
    print_nothing_to_train(state)
    expected = ["longspan: nothing to train: the checkpoint is at iteration 200 = train.train_iters; "
                "raise train.train_iters to continue"]
    assert captured == (expected if rank == 0 else [])
