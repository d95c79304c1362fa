"""``destroy_distributed`` releases what a 2-rank run made: after a TP2 run with asynchronous checkpoint saves
and an FSDP2 run, the process is back to the native threads it had before the run.

Every gloo group keeps three native threads (and its sockets) for as long as anything references it; torch's
DTensor caches held the device meshes of a finished run, the background checkpoint group was kept in a module
global, and FSDP2's state only goes in a second garbage collection. One process that creates worlds again and
again (an in-process restart, a test worker) piled up hundreds of threads that way.
"""

from __future__ import annotations

import pytest

from tests.parallel.test_layout_parity import pretrain_config

pytestmark = pytest.mark.slow


def _native_threads() -> int:
    import os

    return len(os.listdir("/proc/self/task"))


def _train_and_tear_down(root: str, async_save: bool, **layout) -> tuple[int, int, int]:
    """Worker task: (threads before the run, at its end, after ``destroy_distributed``)."""
    import gc

    from longspan.parallel.init import destroy_distributed
    from longspan.training.pretrain import pretrain

    while gc.collect():  # whatever earlier tasks left for the collector is not this run's
        pass
    before = _native_threads()
    cfg = pretrain_config(root, iters=2, **layout)
    if async_save:
        cfg.checkpoint.save = f"{root}/ckpt"
        cfg.checkpoint.save_interval = 1
        cfg.checkpoint.async_save = True
    pretrain(cfg)
    at_end = _native_threads()
    destroy_distributed()
    return before, at_end, _native_threads()


@pytest.mark.parametrize("async_save,layout", [(True, dict(tp=2)), (False, dict(fsdp2=True))],
                         ids=["tp2_async_save", "fsdp2"])
def test_destroy_distributed_releases_the_groups_threads(pool2, tmp_path, async_save, layout) -> None:
    for before, at_end, after in pool2.run(_train_and_tear_down, str(tmp_path), async_save, timeout=240, **layout):
        assert at_end >= before + 6  # the run's groups (three threads each) were alive
        assert after == before, (before, at_end, after)
