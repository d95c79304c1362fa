"""Asynchronous checkpoint saves on 2 ranks (``checkpoint.async_save``): DCP's background save runs its collectives
on a gloo group of its own. On the training group they interleaved with the loop's all-reduces and the run hung
or crashed after its first async save; this run saves asynchronously every 2 iterations while training goes on,
stops at ``exit_interval`` (the pending save is completed before the exit), and a second run resumes from it with
losses equal to an uninterrupted run's, bit for bit (dropout on). Global batch 8: two microbatches per rank."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.layout_parity import logged
from tests.parallel.test_layout_parity import pretrain_config

ITERS = 6


def _async_save_and_resume_case(root: str) -> tuple[dict, dict, list, str, bool]:
    import os

    from longspan.training.checkpointing import async_save as async_checkpoint
    from longspan.training.pretrain import pretrain

    def config(name: str, async_save: bool):
        cfg = pretrain_config(f"{root}/{name}", iters=ITERS)
        cfg.train.global_batch_size = 8
        cfg.model.hidden_dropout = cfg.model.attention_dropout = 0.1
        cfg.checkpoint.save = cfg.checkpoint.load = f"{root}/{name}_ckpt"
        cfg.checkpoint.save_interval = 2
        cfg.checkpoint.async_save = async_save
        return cfg

    pretrain(config("ref", async_save=False))
    cfg = config("async", async_save=True)
    cfg.train.exit_interval = 5  # not a save iteration: the exit saves (async) and completes it
    pretrain(cfg)
    used_own_group = async_checkpoint._checkpoint_group is not None
    saved = sorted(os.listdir(f"{root}/async_ckpt"))
    tracker = Path(f"{root}/async_ckpt/latest_checkpointed_iteration.txt").read_text()
    cfg.train.exit_interval = None
    pretrain(cfg)  # resumes from iteration 5
    return logged(f"{root}/ref"), logged(f"{root}/async"), saved, tracker, used_own_group


@pytest.mark.slow
def test_two_rank_async_save_finishes_and_resumes_bit_exactly(pool2, tmp_path: Path) -> None:
    (ref, got, saved, tracker, own_group), _ = pool2.run(_async_save_and_resume_case, str(tmp_path), timeout=240)
    assert own_group
    assert tracker == "5"
    assert [s for s in saved if s.startswith("iter_")] == ["iter_0000002", "iter_0000004",
                                                           "iter_0000005"]  # no .partial left behind
    assert got["iterations"] == list(range(1, ITERS + 1))  # 1-5, then 6 after the resume
    assert got["losses"] == ref["losses"]  # bit-exact, dropout on
    assert got["norms"] == ref["norms"]
