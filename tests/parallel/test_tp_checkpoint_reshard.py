"""Checkpoints reshard across layouts: save under TP2 at iteration 3, resume under DP2 and under one
process; iterations 4-6 match an uninterrupted one-process run within 1e-5 (relative). Global batch 8 (four
microbatches per iteration under TP2, two per rank under DP2).

The trainer's DCP checkpoint holds model and optimizer state as DTensors by global name, so a tensor-parallel
save loads into DDP's plain replicas or into a single process. Runs ``pretrain`` on the shrunk tiny recipe
(see test_layout_parity.py) through the in-process harness.
"""

from __future__ import annotations

import shutil

import pytest

from tests.parallel.harness import get_shared_pool
from tests.helpers.layout_parity import logged
from tests.parallel.test_layout_parity import REL_TOL, _close, pretrain_config

pytestmark = pytest.mark.slow

ITERS = 6
SAVE_AT = 3


def run_with_checkpoints(run_dir: str, ckpt_dir: str, *, load: bool, stop_at: int | None = None, tp: int = 1) -> int:
    """Worker (or in-process) task: ``pretrain`` for ITERS iterations, saving every SAVE_AT into ``ckpt_dir``."""
    from longspan.training.pretrain import pretrain

    cfg = pretrain_config(run_dir, iters=ITERS, tp=tp)
    cfg.train.global_batch_size = 8
    cfg.checkpoint.save = ckpt_dir
    cfg.checkpoint.save_interval = SAVE_AT
    cfg.checkpoint.load = ckpt_dir if load else None
    if stop_at is not None:
        cfg.train.exit_interval = stop_at
    return pretrain(cfg).train_state.step


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    """ITERS iterations in one process without stopping (checkpoints written but never read)."""
    root = tmp_path_factory.mktemp("uninterrupted")
    run_with_checkpoints(str(root / "run"), str(root / "ckpt"), load=False)
    return logged(str(root / "run"))


@pytest.fixture(scope="module")
def tp2_checkpoint(tmp_path_factory, uninterrupted) -> str:
    """A checkpoint saved by a TP2 run that stopped at iteration SAVE_AT."""
    root = tmp_path_factory.mktemp("tp2")
    steps = get_shared_pool(2).run(run_with_checkpoints, str(root / "run"), str(root / "ckpt"), load=False,
                                   stop_at=SAVE_AT, tp=2, timeout=300)
    assert steps == [SAVE_AT, SAVE_AT]
    first = logged(str(root / "run"))
    assert first["iterations"] == list(range(1, SAVE_AT + 1))
    assert _close(first["losses"], uninterrupted["losses"][:SAVE_AT])
    assert (root / "ckpt" / f"iter_{SAVE_AT:07d}" / ".metadata").exists()
    return str(root / "ckpt")


def _check_resumed(run_dir: str, uninterrupted: dict) -> None:
    got = logged(run_dir)
    assert got["iterations"] == list(range(SAVE_AT + 1, ITERS + 1))
    want = uninterrupted["losses"][SAVE_AT:]
    assert _close(got["losses"], want, REL_TOL), f"resumed {got['losses']} vs uninterrupted {want}"
    assert _close(got["norms"], uninterrupted["norms"][SAVE_AT:], 1e-3)


def test_tp2_checkpoint_resumes_under_dp2(tp2_checkpoint, uninterrupted, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(tp2_checkpoint, ckpt)  # resuming saves again at ITERS: keep the shared copy pristine
    steps = get_shared_pool(2).run(run_with_checkpoints, str(tmp_path / "run"), ckpt, load=True, timeout=300)
    assert steps == [ITERS, ITERS]
    _check_resumed(str(tmp_path / "run"), uninterrupted)


def test_tp2_checkpoint_resumes_in_one_process(tp2_checkpoint, uninterrupted, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(tp2_checkpoint, ckpt)
    assert run_with_checkpoints(str(tmp_path / "run"), ckpt, load=True) == ITERS
    _check_resumed(str(tmp_path / "run"), uninterrupted)
