"""End to end through the `longspan` command: the quickstart run, the self-launcher, multi-node rendezvous on
loopback, signal forwarding, and launch errors that must stop before any worker starts.

The launches start real processes (seconds each on 2 cores), so they are few and marked slow; runs that need no
process of their own (preprocess, then pretrain on its output) call the command's entry point in this process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from longspan.cli import main
from longspan.training.step.forward_step import forward_step
from longspan.training.pretrain import pretrain
from tests.training.pretrain_helpers import losses_by_iteration, small_config
from tests.parallel.harness import free_port

pytestmark = pytest.mark.slow

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1"}
LONGSPAN = [sys.executable, "-m", "longspan"]


def _small_yaml(tmp_path: Path, name: str, **train) -> tuple[Path, object]:
    cfg = small_config(tmp_path, name, **train)
    path = tmp_path / f"{name}.yaml"
    cfg.to_yaml(str(path))
    return path, cfg


@pytest.fixture(scope="module")
def single_process_losses(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    cfg = small_config(tmp_path_factory.mktemp("ref"), "ref", train_iters=6)
    pretrain(cfg, forward_step)
    return losses_by_iteration(cfg)


def _run(args: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(LONGSPAN + args, env=ENV, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize(
    "overrides,nproc,expected",
    [
        (["model.tensor_model_parallel_size=2"], 3, "world size 3 is not divisible"),
        (["model.tensor_model_parallel_size=4", "model.num_query_groups=2"], 4, "num_query_groups"),
    ],
)
def test_bad_layout_fails_before_any_worker_starts(tmp_path: Path, overrides, nproc, expected) -> None:
    config, _ = _small_yaml(tmp_path, "bad")
    result = _run(["pretrain", "--config", str(config), "--nproc-per-node", str(nproc), *overrides], timeout=120)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0] and "Traceback" not in result.stderr
    assert "[rank" not in result.stdout  # no worker ever ran


def test_two_nodes_on_loopback_train_together(tmp_path: Path, single_process_losses) -> None:
    config, cfg = _small_yaml(tmp_path, "nodes", train_iters=6)
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [
        subprocess.Popen(
            LONGSPAN + ["pretrain", "--config", str(config), "--nproc-per-node", "1", "--nnodes", "2",
                        "--node-rank", str(rank), "--rdzv-endpoint", endpoint, "--rdzv-id", "e2e"],
            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for rank in range(2)
    ]
    outputs = [node.communicate(timeout=300) for node in nodes]
    for node, (_, err) in zip(nodes, outputs):
        assert node.returncode == 0, err[-2000:]
    losses = losses_by_iteration(cfg)
    for i in range(1, 7):
        assert losses[i] == pytest.approx(single_process_losses[i], rel=1e-4)


def test_self_launched_data_parallel_matches_one_process_and_saves_on_sigterm(tmp_path: Path) -> None:
    """``--nproc-per-node 2``: the two ranks log one process's losses; SIGTERM to the launcher reaches the workers,
    which save a checkpoint and exit 0 (``train.exit_signal_handler``)."""
    config, cfg = _small_yaml(tmp_path, "dp2", train_iters=100000, exit_signal_handler=True, eval_interval=None)
    reference_cfg = small_config(tmp_path, "one", train_iters=100000, exit_interval=4, eval_interval=None)
    pretrain(reference_cfg, forward_step)  # the same schedule, stopped after 4 iterations
    reference = losses_by_iteration(reference_cfg)
    proc = subprocess.Popen(
        LONGSPAN + ["pretrain", "--config", str(config), "--nproc-per-node", "2"],
        env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    metrics = Path(cfg.logger.tensorboard_dir) / "metrics.jsonl"
    deadline = time.time() + 180
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 4):
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    saved = int((Path(cfg.checkpoint.save) / "latest_checkpointed_iteration.txt").read_text())
    assert saved >= 4
    losses = losses_by_iteration(cfg)
    for i in range(1, 5):
        assert losses[i] == pytest.approx(reference[i], rel=1e-4)


# The first use prepares the shipped corpus (a BPE trained on 3 MB, then tokenized) before 40 iterations:
# about a minute on an idle 2-core machine, over the default 300 s when another suite shares the cores.
@pytest.mark.timeout(900)
def test_quickstart_tiny_recipe_learns_from_the_shipped_corpus(tmp_path: Path) -> None:
    """The issue's acceptance run: 40 iterations of `tiny` on real text, TensorBoard and a checkpoint."""
    save, tb = tmp_path / "ckpt", tmp_path / "tb"
    result = subprocess.run(
        LONGSPAN + ["pretrain", "--recipe", "tiny", "train.train_iters=40", f"checkpoint.save={save}",
                    f"checkpoint.load={save}", f"logger.tensorboard_dir={tb}", "logger.tensorboard_log_interval=1",
                    "logger.log_progress=true"],
        env=ENV, capture_output=True, text=True, timeout=1200, cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(x) for x in (tb / "metrics.jsonl").read_text().splitlines()]
    losses = [r["losses"]["lm loss"] for r in records if r.get("phase") == "train"]
    assert len(losses) == 40
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb))
    acc.Reload()
    assert {"lm loss", "learning-rate", "lm loss validation"} <= set(acc.Tags()["scalars"])
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "40"
    ckpt = save / "iter_0000040"
    assert (ckpt / ".metadata").is_file() and list(ckpt.glob("__*_*.distcp"))
    assert (ckpt / "train_state.pt").is_file() and (ckpt / "run_config.yaml").is_file()
    progress = (save / "progress.txt").read_text()
    assert "Starting job" in progress and "Saved checkpoint\tIteration: 40" in progress
    assert "longspan: done: 40 iterations" in result.stdout


def test_preprocess_then_pretrain_on_the_result_with_a_local_hf_tokenizer(tmp_path: Path) -> None:
    """The raw-text path: JSONL → `longspan preprocess` (local HF tokenizer) → `longspan pretrain` on the prefix."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    docs = [f"def function_{i}(x):\n    return x * {i} + {i % 7}  # number {i}\n" for i in range(600)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer=trainer)
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    tok.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))

    (tmp_path / "data").mkdir()
    prefix = tmp_path / "data" / "code"
    assert main(["preprocess", "--input", str(jsonl), "--output-prefix", str(prefix), "--tokenizer-type",
                 "HuggingFaceTokenizer", "--tokenizer-model", str(tok_dir), "--json-keys", "text", "--append-eod",
                 "--workers", "1", "--no-progress"]) == 0
    data_prefix = f"{prefix}_text_document"
    assert Path(data_prefix + ".bin").is_file() and Path(data_prefix + ".idx").is_file()

    tb = tmp_path / "tb"
    assert main(["pretrain", "--recipe", "tiny", f"dataset.data_path={data_prefix}",
                 "tokenizer.tokenizer_type=HuggingFaceTokenizer", f"tokenizer.tokenizer_model={tok_dir}",
                 "model.vocab_size=null", "train.train_iters=3", "train.eval_interval=3", "train.eval_iters=1",
                 "model.seq_length=64", "dataset.sequence_length=64", "dataset.split=90,8,2",
                 "checkpoint.save=null", "checkpoint.load=null", f"logger.tensorboard_dir={tb}"]) == 0
    records = [json.loads(x) for x in (tb / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records if r.get("phase") == "train"] == [1, 2, 3]
