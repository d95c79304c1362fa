"""Under 2 processes the start-up and finish lines come once per job, not once per rank: the HF import's result
line, the weights' origin, the banner and the summary (each rank's stdout captured in the in-process harness)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conversion.hf_models import make_hf_model
from tests.parallel.harness import get_shared_pool

pytestmark = pytest.mark.slow


def _import_then_finetune(run_dir: str, hf_dir: str) -> tuple[int, list[str]]:
    """convert import (TP2) through the CLI, then finetune from the HF directory (DP2); this rank's stdout."""
    import contextlib
    import io

    from longspan.cli import main
    from longspan.training.finetune import finetune
    from tests.training.pretrain_helpers import small_config

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["convert", "import", "--hf-model", hf_dir, "--output", f"{run_dir}/imported", "--no-progress",
                     "model.tensor_model_parallel_size=2"])
        cfg = small_config(Path(run_dir), "ft", train_iters=2, eval_interval=100, eval_iters=0)
        cfg.checkpoint.load = None
        cfg.checkpoint.pretrained_checkpoint = hf_dir
        cfg.dataset.sequence_length = cfg.model.seq_length = 32
        cfg.optimizer.finetune_lr = 2e-3  # a notice from the config rules, which every rank runs
        finetune(cfg)
    return code, out.getvalue().splitlines()


def test_each_start_up_and_finish_line_is_printed_by_one_rank(tmp_path: Path) -> None:
    hf_dir = tmp_path / "hf"
    make_hf_model("llama", hf_dir)
    (code0, rank0), (code1, rank1) = get_shared_pool(2).run(_import_then_finetune, str(tmp_path), str(hf_dir),
                                                            timeout=180)
    assert code0 == code1 == 0
    lines = rank0 + rank1
    assert lines.count(f"imported {hf_dir} -> {tmp_path / 'imported'}") == 1, lines
    for start in ("optimizer.finetune_lr=", "loaded Hugging Face weights from", "longspan: samples train/valid/test",
                  "longspan: done:"):
        assert sum(m.startswith(start) for m in lines) == 1, (start, lines)
    banner = [m for m in lines if "parameters | world size 2" in m]
    assert len(banner) == 1 and banner[0].endswith(f"| weights from HF directory {hf_dir}, starting at iteration 0")
    assert set(rank0) & set(rank1) == set(), "lines printed by both ranks"
