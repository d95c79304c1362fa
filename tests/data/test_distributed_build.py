"""Two ranks build the same datasets: rank 0 writes the caches first, the others read them."""

from __future__ import annotations

import datetime
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, tmp: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from tests.data.conftest import DatasetCfg, LongspanTok

    from longspan.data.blended import BlendedMegatronDatasetBuilder
    from longspan.data.gpt_dataset import GPTDataset

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        cfg = DatasetCfg(blend=[[f"{tmp}/a", f"{tmp}/b"], [0.4, 0.6]], path_to_cache=f"{tmp}/cache", tokenizer=LongspanTok())
        train = BlendedMegatronDatasetBuilder(GPTDataset, [200, 40, 10], lambda: True, cfg).build()[0]
        torch.save(torch.stack([train[i]["tokens"] for i in range(len(train))]), f"{tmp}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_two_ranks_build_identical_datasets(tmp_path):
    from tests.data.conftest import random_docs, write_corpus

    write_corpus(str(tmp_path / "a"), random_docs(1, 150))
    write_corpus(str(tmp_path / "b"), random_docs(2, 150))
    mp.spawn(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    a, b = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    assert a.shape[0] >= 200 and torch.equal(a, b)
    cached = os.listdir(tmp_path / "cache")
    assert sum(f.endswith("-GPTDataset-train-shuffle_index.npy") for f in cached) == 2
    assert any("-BlendedDataset-train-dataset_index.npy" in f for f in cached)
