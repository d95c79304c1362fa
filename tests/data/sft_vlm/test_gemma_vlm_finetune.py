"""Finetuning a tiny random Gemma 3 VL through the VLM recipes on drawn squares mixed with conversations without
an image: FSDP2 over two ranks and tensor parallel over two ranks (encoder replicated) log the losses of one
process (fp32, rel <= 1e-5, every one of 8 iterations) although some ranks' microbatches hold no image (they run
the encoder on a blank image times 0, so every rank reduces the same gradients)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.data.sft_vlm.conftest import write_jsonl
from tests.data.sft_vlm.gemma_fixtures import gemma_colour_rows, make_gemma_vl_dir
from tests.training.pretrain_helpers import losses_by_iteration

ITERS = 8
REL = 1e-5  # fp32 CPU layout parity


@pytest.fixture(scope="module")
def gemma_run_inputs(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny random Gemma 3 VL HF directory and colour questions, every second one without an image."""
    root = tmp_path_factory.mktemp("gemma-vlm-run")
    hf, data = make_gemma_vl_dir(root / "hf"), root / "data"
    rows = gemma_colour_rows(str(data), 24, seed=1, text_only_every=2)
    write_jsonl(str(data / "training.jsonl"), rows[:16])
    write_jsonl(str(data / "validation.jsonl"), rows[16:])
    return hf, data


def gemma_sft_config(hf: Path, data: Path, out: Path, tp: int = 1, fsdp: bool = False, recipe: str = "vlm-sft"):
    from longspan.recipes.loading import load_config

    return load_config(recipe, overrides=[
        f"checkpoint.pretrained_checkpoint={hf}", f"dataset.dataset_root={data}", "checkpoint.save=null",
        "checkpoint.load=null", f"logger.tensorboard_dir={out}/tb", "logger.log_interval=1", "model.seq_length=32",
        f"train.train_iters={ITERS}", "train.eval_iters=0", "train.global_batch_size=4", "train.micro_batch_size=2",
        "optimizer.lr=1e-3", "scheduler.lr_warmup_iters=0", "dist.distributed_backend=gloo",
        "dist.distributed_timeout_minutes=1", f"model.tensor_model_parallel_size={tp}", f"dist.use_torch_fsdp2={fsdp}",
    ])


def _finetune_case(cfg) -> int:
    from longspan.training.finetune import finetune

    finetune(cfg)
    return 0


@pytest.fixture(scope="module")
def gemma_one_process_run(gemma_run_inputs, tmp_path_factory):
    hf, data = gemma_run_inputs
    cfg = gemma_sft_config(hf, data, tmp_path_factory.mktemp("gemma-one"))
    _finetune_case(cfg)
    return cfg


@pytest.mark.parametrize("layout", ["fsdp2", "tp2"])
def test_gemma_vlm_layouts_with_text_only_microbatches_log_the_losses_of_one_process(
        gemma_run_inputs, gemma_one_process_run, tmp_path, pool2, layout):
    hf, data = gemma_run_inputs
    cfg = gemma_sft_config(hf, data, tmp_path / layout, tp=2 if layout == "tp2" else 1, fsdp=layout == "fsdp2")
    pool2.run(_finetune_case, cfg, timeout=300)
    got, want = losses_by_iteration(cfg), losses_by_iteration(gemma_one_process_run)
    assert sorted(got) == sorted(want) == list(range(1, ITERS + 1))
    for it in want:
        assert math.isclose(got[it], want[it], rel_tol=REL), f"{layout} iteration {it}: {got[it]} vs {want[it]}"
    assert want[ITERS] < want[1]
