"""Fixtures of the direct HF SFT data tests: the tiny BPE tokenizer of the SFT tests, 50 conversations of
uneven shape (system prompts or not, one to three exchanges) and writers for the file formats users hold."""

from __future__ import annotations

import json
import os
import random
from typing import Any

import pytest

from tests.data.sft.conftest import make_hf_tokenizer_dir

WORDS = "the quick brown fox jumps over lazy dog hello world stone question answer".split()
SEQ = 128


@pytest.fixture(autouse=True)
def _longspan_cache(tmp_path, monkeypatch):
    """The datasets Arrow cache goes to the test's own directory (never ~/.cache, never the data directory)."""
    monkeypatch.setenv("LONGSPAN_CACHE", str(tmp_path / "longspan-cache"))


@pytest.fixture(scope="session")
def hf_sft_tokenizer_dir(tmp_path_factory) -> str:
    return make_hf_tokenizer_dir(str(tmp_path_factory.mktemp("hf-sft-tok")))


@pytest.fixture(scope="session")
def hf_sft_tokenizer(hf_sft_tokenizer_dir):
    from longspan.data.tokenizers import HuggingFaceTokenizer

    return HuggingFaceTokenizer(hf_sft_tokenizer_dir)


def _sentence(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def conversations(n: int = 50, seed: int = 0) -> list[list[dict[str, str]]]:
    """``n`` OpenAI-style conversations: about a third with a system prompt, about half single-turn."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        messages = [{"role": "system", "content": _sentence(rng, 2, 5)}] if rng.random() < 0.35 else []
        for _ in range(1 if rng.random() < 0.5 else rng.randint(2, 3)):
            messages.append({"role": "user", "content": _sentence(rng, 1, 6)})
            messages.append({"role": "assistant", "content": _sentence(rng, 1, 5)})
        out.append(messages)
    return out


def single_turn(convs: list[list[dict[str, str]]]) -> list[list[dict[str, str]]]:
    return [c for c in convs if sum(m["role"] == "assistant" for m in c) == 1]


SHAREGPT_SPEAKERS = {"system": "system", "user": "human", "assistant": "gpt"}


def as_sharegpt(conv: list[dict[str, str]]) -> dict[str, Any]:
    return {"conversations": [{"from": SHAREGPT_SPEAKERS[m["role"]], "value": m["content"]} for m in conv]}


def as_alpaca(conv: list[dict[str, str]]) -> dict[str, Any]:
    system = [m["content"] for m in conv if m["role"] == "system"]
    user = next(m["content"] for m in conv if m["role"] == "user")
    answer = next(m["content"] for m in conv if m["role"] == "assistant")
    return {"instruction": user, "input": "", "output": answer, "system": system[0] if system else ""}


def write_jsonl(path: str, rows: list[dict[str, Any]]) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return path


def write_json_array(path: str, rows: list[dict[str, Any]]) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(rows, f)
    return path


def write_parquet(path: str, rows: list[dict[str, Any]]) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(os.path.dirname(path), exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_saved_dataset(path: str, splits: dict[str, list[dict[str, Any]]]) -> str:
    import datasets

    datasets.DatasetDict({k: datasets.Dataset.from_list(v) for k, v in splits.items()}).save_to_disk(path)
    return path


def snapshot(directory: str) -> dict[str, float]:
    """Every file under ``directory`` with its modification time (to prove nothing was written there)."""
    out = {}
    for root, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(root, name)
            out[path] = os.path.getmtime(path)
    return out


from tests.parallel.conftest import pool2  # noqa: E402,F401 - the shared two-rank pool for the distributed build
