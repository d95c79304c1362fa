"""Checkpoint writing switches: storage_writers_per_rank (DCP writer threads, one file each),
ckpt_assume_constant_structure (DCP's save plan cached across saves), save_tokenizer_assets (tokenizer files in
each checkpoint or not). A run with all three changed writes what they say and resumes bit-exact."""

from __future__ import annotations

from longspan.training.pretrain import pretrain
from tests.training.pretrain_helpers import losses_by_iteration, tiniest_config


def _files(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_writer_threads_plan_cache_and_tokenizer_assets_then_resume(tmp_path) -> None:
    from torch.distributed.checkpoint.planner import SavePlanner

    from longspan.training.checkpointing.async_save import plan_cache_key

    changed = tiniest_config(tmp_path, "changed", train_iters=4)
    changed.checkpoint.save_interval = 2
    changed.checkpoint.storage_writers_per_rank = 3
    changed.checkpoint.ckpt_assume_constant_structure = True
    changed.checkpoint.save_tokenizer_assets = False
    pretrain(changed)
    # the same run resumed from iteration 2 with the defaults: bit-exact, and it saves iteration 4 its own way
    resumed = tiniest_config(tmp_path, "resumed", train_iters=4)
    resumed.checkpoint.load, resumed.checkpoint.ckpt_step = changed.checkpoint.save, 2
    resumed.checkpoint.save_interval = 2
    pretrain(resumed)
    want, got = losses_by_iteration(changed), losses_by_iteration(resumed)
    assert sorted(got) == [3, 4] and all(got[i] == want[i] for i in (3, 4))

    changed_dir = tmp_path / "changed" / "ckpt" / "iter_0000004"
    plain_dir = tmp_path / "resumed" / "ckpt" / "iter_0000004"
    assert [f for f in _files(plain_dir) if f.endswith(".distcp")] == ["__0_0.distcp"]
    assert [f for f in _files(changed_dir) if f.endswith(".distcp")] == ["__0_0.distcp", "__0_1.distcp", "__0_2.distcp"]
    assert "tokenizer" in _files(plain_dir) and "tokenizer" not in _files(changed_dir)
    assert plan_cache_key(tmp_path / "changed" / "ckpt") in SavePlanner._cached_all_plans
    assert plan_cache_key(tmp_path / "resumed" / "ckpt") not in SavePlanner._cached_all_plans
