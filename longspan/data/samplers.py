"""Megatron's pretraining batch samplers, which start from the number of samples already consumed.

A run resumed from a checkpoint rebuilds its samplers with the checkpoint's ``consumed_samples`` and sees
exactly the micro-batches the uninterrupted run would have seen next.
"""

from __future__ import annotations

from typing import Any, Iterator, List

import torch

from longspan.core.errors import DataError


class MegatronPretrainingSampler:
    """Samples in order, once: each global batch of ``micro_batch_size * dp`` consecutive indices is cut
    into one micro-batch per data-parallel rank.

    Args:
        total_samples: length of the dataset.
        consumed_samples: samples already consumed by all ranks together (where to start).
        micro_batch_size: samples per micro-batch.
        data_parallel_rank / data_parallel_size: this rank's slot in each global batch.
        drop_last: drop a last incomplete global batch.
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        drop_last: bool = True,
    ) -> None:
        if total_samples <= 0:
            raise DataError(f"the dataset has no samples (total_samples={total_samples}); check dataset.split and the data")
        if consumed_samples >= total_samples:
            raise DataError(
                f"consumed_samples={consumed_samples} is not below the dataset's {total_samples} samples: "
                f"the checkpoint has already read all the data this config builds"
            )
        if micro_batch_size <= 0 or data_parallel_size <= 0 or not 0 <= data_parallel_rank < data_parallel_size:
            raise DataError(
                f"sampler: micro_batch_size={micro_batch_size}, data_parallel_rank={data_parallel_rank}, "
                f"data_parallel_size={data_parallel_size} are not valid"
            )
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.drop_last = drop_last

    def __len__(self) -> int:
        return self.total_samples

    def _slot(self, batch: List[int]) -> List[int]:
        start = self.data_parallel_rank * self.micro_batch_size
        return batch[start : start + self.micro_batch_size]

    def __iter__(self) -> Iterator[List[int]]:
        step = self.micro_batch_times_data_parallel_size
        start = self.consumed_samples
        full_end = start + (self.total_samples - start) // step * step
        for begin in range(start, full_end, step):
            yield self._slot(list(range(begin, begin + step)))
        if full_end < self.total_samples and not self.drop_last:
            yield self._slot(list(range(full_end, self.total_samples)))


class MegatronPretrainingRandomSampler:
    """Samples in a fresh random order each epoch (``torch.randperm`` seeded by the epoch number).

    With ``data_sharding`` each data-parallel rank draws from its own contiguous bucket of the dataset;
    without it every rank takes a strided share of one global permutation. A last incomplete global batch
    of each epoch is dropped.
    """

    def __init__(
        self,
        dataset: Any,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        data_sharding: bool,
    ) -> None:
        self.dataset = dataset
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.data_sharding = data_sharding
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.last_batch_size = total_samples % self.micro_batch_times_data_parallel_size
        if total_samples < self.micro_batch_times_data_parallel_size:
            raise DataError(
                f"the dataset has {total_samples} samples, fewer than one global micro-batch "
                f"({micro_batch_size} x {data_parallel_size} ranks)"
            )

    def __len__(self) -> int:
        return self.total_samples

    def __iter__(self) -> Iterator[List[int]]:
        active_total = self.total_samples - self.last_batch_size
        epoch = self.consumed_samples // active_total
        in_epoch = self.consumed_samples % active_total
        if in_epoch % self.micro_batch_times_data_parallel_size != 0:
            raise DataError(
                f"consumed_samples={self.consumed_samples} is not a whole number of global micro-batches "
                f"({self.micro_batch_times_data_parallel_size})"
            )
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)
        g = torch.Generator()
        g.manual_seed(epoch)
        if self.data_sharding:
            bucket_size = (self.total_samples // self.micro_batch_times_data_parallel_size) * self.micro_batch_size
            bucket_offset = in_epoch // self.data_parallel_size
            start = self.data_parallel_rank * bucket_size
            order = torch.randperm(bucket_size, generator=g).tolist()
            indices = [start + x for x in order[bucket_offset:]]
        else:
            full_bucket = (self.total_samples // self.micro_batch_size) * self.micro_batch_size
            order = torch.randperm(full_bucket, generator=g).tolist()
            indices = order[in_epoch:][self.data_parallel_rank :: self.data_parallel_size]
        batch: List[int] = []
        for idx in indices:
            batch.append(idx)
            if len(batch) == self.micro_batch_size:
                self.consumed_samples += self.micro_batch_times_data_parallel_size
                yield batch
                batch = []
