"""Shared fixtures of the data tests: small .bin/.idx corpora, configs with the tests' defaults, megatron-core
oracles."""

from __future__ import annotations

import warnings
from typing import Any, List, Optional

import numpy as np
import pytest

from longspan.training.config import (
    ConfigContainer,
    GPTDatasetConfig,
    GPTModelProvider,
    TokenizerConfig,
    TrainingConfig,
)


def gpt_dataset_config(**fields: Any) -> GPTDatasetConfig:
    """A GPTDatasetConfig with the tests' defaults: 64-token samples, split 90,8,2, no resets, in-process loading."""
    defaults: dict[str, Any] = dict(
        random_seed=1234, sequence_length=64, split="90,8,2", reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=False, dataloader_type="single", num_workers=0, pin_memory=False,
    )
    return GPTDatasetConfig(**{**defaults, **fields})


def run_config(dataset: Any, seq_length: int = 64, **train: Any) -> ConfigContainer:
    """A ConfigContainer with the sections the data loaders read: ``train`` (TrainingConfig fields), ``dataset``,
    a GPT model of ``seq_length`` and a tokenizer section without a chat template."""
    return ConfigContainer(train=TrainingConfig(**train), dataset=dataset, model=GPTModelProvider(seq_length=seq_length),
                           tokenizer=TokenizerConfig())


class OracleTokenizer:
    """What megatron-core's datasets read from a tokenizer: vocab_size, eod, pad (+ unique_identifiers)."""

    def __init__(self, vocab_size: int = 1000, eod: int = 0, pad: Optional[int] = None) -> None:
        self.vocab_size = vocab_size
        self.eod = eod
        self.eos = eod
        self._pad = pad
        self.unique_identifiers = {"class": "OracleTokenizer", "vocab_size": vocab_size}

    @property
    def pad(self):
        if self._pad is None:
            raise AttributeError("no pad")
        return self._pad


class LongspanTok:
    """The same special ids in the shape longspan tokenizers have (pad None when there is none)."""

    def __init__(self, vocab_size: int = 1000, eod: int = 0, pad: Optional[int] = None) -> None:
        self.vocab_size, self.eod, self.eos, self.pad, self.bos = vocab_size, eod, eod, pad, None


def write_corpus(prefix: str, docs: List[np.ndarray], dtype=np.uint16) -> None:
    """Write documents as .bin/.idx (longspan's builder: test_indexed_dataset proves it byte-identical to
    megatron-core's, and importing megatron-core costs seconds in tests that do not need it)."""
    from longspan.data.indexed_dataset import IndexedDatasetBuilder

    b = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for d in docs:
        b.add_item(d)
        b.end_document()
    b.finalize(prefix + ".idx")


def random_docs(seed: int, n: int, vocab: int = 1000, eod: int = 0, max_len: int = 200) -> List[np.ndarray]:
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(n):
        length = int(rng.integers(1, max_len))
        body = rng.integers(1, vocab, size=length)
        docs.append(np.concatenate([body, [eod]]).astype(np.int64))
    return docs


@pytest.fixture(autouse=True)
def _quiet_megatron():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@pytest.fixture
def two_prefixes(tmp_path):
    p1, p2 = str(tmp_path / "a_text_document"), str(tmp_path / "b_text_document")
    write_corpus(p1, random_docs(1, 300))
    write_corpus(p2, random_docs(2, 200))
    return p1, p2
