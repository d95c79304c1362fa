"""Two ranks build the same datasets: rank 0 writes the caches first, the others read them."""

from __future__ import annotations

import os

import pytest
import torch

from tests.parallel.harness import get_shared_pool, init_gloo


def _build_task(tmp: str) -> torch.Tensor:
    """On each of 2 ranks (the shared worker pool; it tears the process group down after the task)."""
    from tests.data.conftest import LongspanTok, gpt_dataset_config

    from longspan.data.blended import BlendedMegatronDatasetBuilder
    from longspan.data.gpt_dataset import GPTDataset

    init_gloo()
    cfg = gpt_dataset_config(blend=[[f"{tmp}/a", f"{tmp}/b"], [0.4, 0.6]], path_to_cache=f"{tmp}/cache", tokenizer=LongspanTok())
    train = BlendedMegatronDatasetBuilder(GPTDataset, [200, 40, 10], lambda: True, cfg).build()[0]
    return torch.stack([train[i]["tokens"] for i in range(len(train))])


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_two_ranks_build_identical_datasets(tmp_path):
    from tests.data.conftest import random_docs, write_corpus

    write_corpus(str(tmp_path / "a"), random_docs(1, 150))
    write_corpus(str(tmp_path / "b"), random_docs(2, 150))
    a, b = get_shared_pool(2).run(_build_task, str(tmp_path), timeout=120)
    assert a.shape[0] >= 200 and torch.equal(a, b)
    cached = os.listdir(tmp_path / "cache")
    assert sum(f.endswith("-GPTDataset-train-shuffle_index.npy") for f in cached) == 2
    assert any("-BlendedDataset-train-dataset_index.npy" in f for f in cached)
