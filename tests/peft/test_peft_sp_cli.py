"""From the command line: HF model in -> `longspan finetune --recipe lora --nproc-per-node 2` with tensor and
sequence parallel -> `longspan convert export` (HF PEFT adapter and merged HF model) out, equal to the same
recipe and overrides finetuned in one process (losses rel 1e-5, adapter and merged weights <= 1e-6)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import transformers
from safetensors.torch import load_file

from longspan.cli import main as cli_main
from longspan.peft.hf_export import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from tests.conversion.hf_models import make_hf_model
from tests.data.sft.conftest import qa_records, write_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ITERS = 4
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1"}


def _overrides(root: Path, name: str, tp: int) -> list[str]:
    out = root / name
    return [
        f"checkpoint.pretrained_checkpoint={root / 'hf'}", f"dataset.dataset_root={root / 'data'}",
        "dataset.do_validation=false", f"checkpoint.save={out}", f"checkpoint.load={out}",
        f"checkpoint.save_interval={ITERS}", f"logger.tensorboard_dir={out}/tb", "logger.log_interval=1",
        "model.seq_length=32", f"train.train_iters={ITERS}", "train.eval_iters=0", "train.micro_batch_size=2",
        "train.global_batch_size=8", "scheduler.lr_warmup_iters=1",
        # SGD: Adam turns 1e-7 summation-order differences of near-zero gradients into ~1e-6 weight differences
        # (see test_peft_sequence_parallel.py); the Adam run under TP2+SP is proven in test_peft_layouts.py.
        "optimizer.optimizer=sgd", "optimizer.lr=0.5", "peft.dim=4", "peft.alpha=8", "peft.dropout=0.1",
        "dist.distributed_backend=gloo", f"model.tensor_model_parallel_size={tp}",
        f"model.sequence_parallel={'true' if tp > 1 else 'false'}",
    ]


def _losses(run: Path) -> list[float]:
    rows = [json.loads(line) for line in (run / "tb" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r.get("phase", "train") == "train"]
    assert [r["iteration"] for r in rows] == list(range(1, ITERS + 1))
    return [r["losses"]["lm loss"] for r in rows]


def _max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b) and a
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def test_cli_lora_finetune_under_tp2_sp_exports_the_one_process_model(tmp_path: Path) -> None:
    make_hf_model("llama", tmp_path / "hf")
    write_jsonl(str(tmp_path / "data" / "training.jsonl"), qa_records(48, seed=5, skew=True))

    result = subprocess.run(
        [sys.executable, "-m", "longspan", "finetune", "--recipe", "lora", "--nproc-per-node", "2",
         *_overrides(tmp_path, "tp2sp", tp=2)],
        env=ENV, cwd=tmp_path, capture_output=True, text=True, timeout=500)
    assert result.returncode == 0, result.stderr[-3000:]
    assert cli_main(["finetune", "--recipe", "lora", *_overrides(tmp_path, "ref", tp=1)]) == 0

    assert _losses(tmp_path / "tp2sp") == pytest.approx(_losses(tmp_path / "ref"), rel=1e-5)
    for name in ("ref", "tp2sp"):
        for extra, out in ((["--adapter-only"], "adapter"), ([], "merged")):
            assert cli_main(["convert", "export", "--checkpoint", str(tmp_path / name), "--output",
                             str(tmp_path / f"{name}_{out}"), "--no-progress", *extra]) == 0
    adapter = {n: load_file(str(tmp_path / f"{n}_adapter" / ADAPTER_WEIGHTS)) for n in ("ref", "tp2sp")}
    assert _max_diff(adapter["ref"], adapter["tp2sp"]) <= 1e-6
    configs = [json.loads((tmp_path / f"{n}_adapter" / ADAPTER_CONFIG).read_text()) for n in ("ref", "tp2sp")]
    assert configs[0] == configs[1]
    merged = {n: transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / f"{n}_merged")).state_dict()
              for n in ("ref", "tp2sp")}
    assert _max_diff(merged["ref"], merged["tp2sp"]) <= 1e-6
    base = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).state_dict()
    assert _max_diff(base, merged["tp2sp"]) > 1e-4  # the merged adapters moved the weights
