"""logger.log_eval_samples under tensor parallelism and FSDP2: every rank decodes, the last rank logs, and the
samples equal one process's (the same weights: lr 0; greedy)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.parallel.harness import get_shared_pool

pytestmark = pytest.mark.slow


def _run(run_dir: str, tp: int = 1, fsdp2: bool = False) -> list[dict]:
    """Worker task (or one process): 2 iterations with an evaluation each; the eval_samples records."""
    from longspan.training.pretrain import pretrain
    from tests.training.pretrain_helpers import small_config

    cfg = small_config(Path(run_dir), train_iters=2, eval_interval=1, eval_iters=1)
    cfg.checkpoint.save = cfg.checkpoint.load = None
    cfg.optimizer.lr = cfg.optimizer.min_lr = 0.0  # the weights stay those every layout draws
    cfg.model.tensor_model_parallel_size = tp
    cfg.dist.use_torch_fsdp2 = fsdp2
    cfg.dist.distributed_backend = "gloo"
    cfg.dist.distributed_timeout_minutes = 1
    cfg.logger.log_eval_samples = 2
    cfg.logger.eval_samples_max_new_tokens = 6
    pretrain(cfg)
    path = Path(cfg.logger.tensorboard_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    records = [r for r in map(json.loads, path.read_text().splitlines()) if r.get("phase") == "eval_samples"]
    # the run's name and launch id name the directory and the moment, not what was generated
    return [{k: v for k, v in r.items() if k not in ("run", "run_id")} for r in records]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    records = _run(str(tmp_path_factory.mktemp("one")))
    assert [r["iteration"] for r in records] == [1, 2] and len(records[0]["samples"]) == 2
    return records


@pytest.mark.parametrize("layout", [dict(tp=2), dict(fsdp2=True)], ids=["tp2", "dp2_fsdp2"])
def test_sharded_layouts_generate_what_one_process_generates(tmp_path: Path, layout: dict,
                                                             reference: list[dict]) -> None:
    results = get_shared_pool(2).run(_run, str(tmp_path / "two"), **layout, timeout=240)
    assert results[-1] == reference  # metrics.jsonl, written by the last rank (as read there)
