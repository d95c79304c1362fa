"""A small T5 run for the T5 training and layout tests: the tiny-t5 recipe shrunk to seconds per run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from longspan.data.indexed_dataset import IndexedDatasetBuilder
from longspan.recipes import get_recipe
from tests.training.pretrain_helpers import small_run_settings


def write_byte_corpus(directory: Path) -> str:
    """longspan's own source files as UTF-8 bytes (ByteLevelTokenizer ids), one document per file, split into
    uneven 'sentences' of up to 40 lines; returns the data prefix."""
    prefix = directory / "bytes"
    if Path(str(prefix) + ".idx").exists():
        return str(prefix)
    directory.mkdir(parents=True, exist_ok=True)
    sources = sorted((Path(__file__).resolve().parents[3] / "longspan").rglob("*.py"))[:60]
    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=np.int32)
    for path in sources:
        lines = path.read_text().splitlines(keepends=True)
        for start in range(0, len(lines), 7 + len(lines) % 33):
            text = "".join(lines[start: start + 7 + len(lines) % 33]).encode()
            if text:
                builder.add_item(torch.tensor(list(text[:500])))
        builder.end_document()
    builder.finalize(str(prefix) + ".idx")
    return str(prefix)


def small_t5_run(tmp_path: Path, name: str = "run", dropout: float = 0.0, data_dir: Any = None,
                 **train_overrides: Any) -> Any:
    """tiny-t5 with hidden 32, 2+2 layers, 4 heads of 8, encoder 64 / decoder 32 tokens, byte-level tokenizer
    with 20 sentinels, 4 microbatches of 2, 12 iterations, hidden and attention dropout ``dropout``. The corpus
    is written under ``data_dir`` (default ``tmp_path/data``) unless it is there already."""
    cfg = get_recipe("tiny-t5")
    model = cfg.model
    model.hidden_size = 32
    model.ffn_hidden_size = 64
    model.kv_channels = 8
    model.seq_length = 64
    model.seq_length_dec = 32
    model.max_position_embeddings = 64
    model.make_vocab_size_divisible_by = 16
    model.hidden_dropout = dropout
    model.attention_dropout = dropout
    cfg.tokenizer.tokenizer_type = "ByteLevelTokenizer"
    cfg.tokenizer.tokenizer_model = None
    cfg.tokenizer.vocab_extra_ids = 20
    cfg.dataset.data_path = write_byte_corpus(Path(data_dir) if data_dir is not None else Path(tmp_path) / "data")
    cfg.dataset.split = "90,5,5"
    cfg.dataset.sequence_length = 64
    cfg.dataset.sequence_length_decoder = 32
    cfg.optimizer.lr = 3e-3
    return small_run_settings(cfg, Path(tmp_path) / name, 12, 6, 1, 2, train_overrides)
