"""Small single-process runs of the real trainer for the training tests (mock data, 2 layers, hidden 64)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from longspan.recipes import get_recipe


def small_config(tmp_path: Path, name: str = "run", **train_overrides: Any) -> Any:
    """The tiny recipe shrunk to seconds per run: mock data, NullTokenizer, 4 microbatches of 2 × 64 tokens."""
    cfg = get_recipe("tiny")
    model = cfg.model
    model.num_layers = 2
    model.hidden_size = 64
    model.ffn_hidden_size = 128
    model.num_attention_heads = 4
    model.num_query_groups = 2
    null_tokenizer_mock_data(cfg, 64)
    return small_run_settings(cfg, Path(tmp_path) / name, 30, 10, 2, None, train_overrides)


def null_tokenizer_mock_data(cfg: Any, seq: int) -> Any:
    """NullTokenizer (vocabulary 255; the model's vocabulary from the tokenizer) on mock data of ``seq`` tokens."""
    cfg.model.seq_length, cfg.model.vocab_size = seq, None
    cfg.tokenizer.tokenizer_type, cfg.tokenizer.tokenizer_model, cfg.tokenizer.vocab_size = "NullTokenizer", None, 255
    cfg.dataset.data_path, cfg.dataset.sequence_length = None, seq
    return cfg


def small_run_settings(cfg: Any, run_dir: Path, train_iters: int, eval_interval: int, eval_iters: int,
                       warmup_iters: int | None, train_overrides: dict[str, Any]) -> Any:
    """The run settings the small test configs share: 4 microbatches of 2 (global batch 8), ``train_iters``
    iterations evaluated every ``eval_interval`` on ``eval_iters`` batches, then ``train_overrides`` set on
    ``cfg.train``; a warmup of ``warmup_iters`` iterations (None: 3, fewer for runs of 3 iterations or less);
    checkpoints in ``run_dir``/ckpt (none periodic); every iteration logged to ``run_dir``/tb."""
    t = cfg.train
    t.micro_batch_size, t.global_batch_size = 2, 8
    t.train_iters, t.eval_interval, t.eval_iters = train_iters, eval_interval, eval_iters
    for key, value in train_overrides.items():
        setattr(t, key, value)
    cfg.scheduler.lr_warmup_fraction = None
    if warmup_iters is None:
        # Warmup must be shorter than the decay (Megatron Core asserts it): 3 iterations, fewer for short runs.
        warmup_iters = 3 if t.train_iters is None else min(3, max(0, t.train_iters - 1))
    cfg.scheduler.lr_warmup_iters = warmup_iters
    cfg.checkpoint.save = str(run_dir / "ckpt")
    cfg.checkpoint.load = str(run_dir / "ckpt")
    cfg.checkpoint.save_interval = None
    cfg.logger.log_interval = 1
    cfg.logger.tensorboard_dir = str(run_dir / "tb")
    return cfg


def read_metrics(cfg: Any) -> list[dict[str, Any]]:
    """Per-iteration training records of metrics.jsonl (validation records left out)."""
    path = Path(cfg.logger.tensorboard_dir) / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if r.get("phase", "train") == "train"]


def losses_by_iteration(cfg: Any) -> dict[int, float]:
    return {r["iteration"]: r["losses"]["lm loss"] for r in read_metrics(cfg)}


def write_token_corpus(directory: Path, documents: int = 400, seed: int = 0, lengths: tuple = (3, 90)) -> str:
    """A real indexed dataset (NullTokenizer ids, uneven document lengths drawn from ``lengths``: a range
    (lo, hi) or, with three or more entries, a choice) through ``longspan preprocess``; returns the prefix."""
    import random

    from longspan.cli import main

    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    source = directory / "corpus.jsonl"
    with source.open("w") as f:
        for _ in range(documents):
            size = rng.choice(lengths) if len(lengths) > 2 else rng.randrange(*lengths)
            ids = [str(rng.randrange(255)) for _ in range(size)]
            f.write(json.dumps({"text": " ".join(ids)}) + "\n")
    prefix = directory / "corpus"
    code = main(["preprocess", "--input", str(source), "--output-prefix", str(prefix), "--tokenizer-type",
                 "NullTokenizer", "--vocab-size", "255", "--append-eod", "--no-progress"])
    assert code == 0
    return f"{prefix}_text_document"


def with_dropout_and_real_data(cfg: Any, data_prefix: str, dropout: float = 0.1) -> Any:
    """Hidden and attention dropout on (every step draws from the RNG) over a real dataset, end-of-document
    tokens masked (microbatches count different numbers of loss tokens)."""
    cfg.model.hidden_dropout = dropout
    cfg.model.attention_dropout = dropout
    cfg.dataset.data_path = data_prefix
    cfg.dataset.split = "90,8,2"
    cfg.dataset.eod_mask_loss = True
    return cfg


def mock_layout_run(cfg: Any, tb_dir: str, seq: int, micro: int, global_batch: int, iters: int) -> Any:
    """``cfg`` set up for a layout-parity run of the real trainer: NullTokenizer (vocabulary 255) on mock data
    of ``seq`` tokens, ``iters`` iterations of ``global_batch`` in microbatches of ``micro``, no evaluation, no
    checkpoints, a 2-iteration warmup, gloo with a one-minute timeout, every iteration logged to ``tb_dir``."""
    null_tokenizer_mock_data(cfg, seq)
    t = cfg.train
    t.micro_batch_size, t.global_batch_size, t.train_iters, t.eval_interval, t.eval_iters = (
        micro, global_batch, iters, None, 0)
    cfg.scheduler.lr_warmup_fraction, cfg.scheduler.lr_warmup_iters = None, 2
    cfg.dist.distributed_backend, cfg.dist.distributed_timeout_minutes = "gloo", 1
    cfg.checkpoint.save = cfg.checkpoint.load = None
    cfg.logger.log_interval = 1
    cfg.logger.tensorboard_dir = tb_dir
    return cfg


def tiniest_config(tmp_path: Path, name: str = "run", train_iters: int = 6, **train_overrides: Any) -> Any:
    """``small_config`` cut to about a second per run for tests of one trainer behaviour: one layer of hidden 32,
    16-token sequences, a 63-token vocabulary, global batches of 2, one warmup iteration, no evaluation."""
    cfg = small_config(tmp_path, name, train_iters=train_iters, eval_interval=None, **train_overrides)
    m = cfg.model
    m.num_layers, m.hidden_size, m.ffn_hidden_size, m.num_attention_heads, m.num_query_groups = 1, 32, 64, 4, 2
    m.seq_length = cfg.dataset.sequence_length = 16
    cfg.tokenizer.vocab_size = 63
    cfg.train.global_batch_size = 2
    cfg.scheduler.lr_warmup_iters = 1
    return cfg
