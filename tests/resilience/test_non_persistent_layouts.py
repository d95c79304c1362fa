"""Local non-persistent checkpoints with sharded state (DTensor model and optimizer shards under TP2 and FSDP2): a
2-rank run that crashes in iteration 6 resumes from the local save of iteration 4 (the save of 2 cleaned up) and
matches an uninterrupted run bit for bit (dropout on). Global batch 8: four microbatches per iteration under TP2,
two per rank under FSDP2."""

from __future__ import annotations

import pytest

from tests.helpers.layout_parity import logged
from tests.parallel.test_layout_parity import pretrain_config

pytestmark = pytest.mark.slow

ITERS = 6


def _crash_and_resume_case(root: str, tp: int, fsdp2: bool) -> tuple[dict, dict, list]:
    from longspan.training.step.forward_step import forward_step
    from longspan.training.pretrain import pretrain
    from longspan.training.checkpointing.non_persistent import local_iterations

    def config(name: str):
        cfg = pretrain_config(f"{root}/{name}", iters=ITERS, tp=tp, fsdp2=fsdp2)
        cfg.train.global_batch_size = 8
        cfg.model.hidden_dropout = cfg.model.attention_dropout = 0.1
        cfg.checkpoint.save = cfg.checkpoint.load = f"{root}/{name}_ckpt"
        return cfg

    pretrain(config("ref"))
    cfg = config("np")
    cfg.checkpoint.non_persistent_ckpt_type = "local"
    cfg.checkpoint.non_persistent_save_interval = 2
    cfg.checkpoint.non_persistent_local_ckpt_dir = f"{root}/node_local"

    def crashing_forward_step(state, data_iterator, model, return_schedule_plan=False):
        if state.train_state.step == 5:
            raise RuntimeError("simulated crash in iteration 6")
        return forward_step(state, data_iterator, model)

    with pytest.raises(RuntimeError, match="simulated crash"):
        pretrain(cfg, crashing_forward_step)
    saved = local_iterations(cfg.checkpoint)
    pretrain(cfg)  # the same command again
    return logged(f"{root}/ref"), logged(f"{root}/np"), saved


@pytest.mark.parametrize("tp, fsdp2", [(2, False), (1, True)], ids=["tp2", "fsdp2"])
def test_local_checkpoint_resume_with_sharded_state(pool2, tmp_path, tp: int, fsdp2: bool) -> None:
    (ref, got, saved), _ = pool2.run(_crash_and_resume_case, str(tmp_path), tp, fsdp2, timeout=300)
    assert saved == [4]
    assert got["iterations"] == list(range(1, 6)) + list(range(5, ITERS + 1))  # 5 ran again after the resume from 4
    final = dict(zip(got["iterations"], got["losses"]))
    assert [final[i] for i in range(1, ITERS + 1)] == ref["losses"]  # bit-exact, dropout on
