"""Blends of datasets and the builder of the train/valid/test splits (megatron-core's semantics).

``BlendedMegatronDatasetBuilder(cls, sizes, is_built_on_rank, config).build()`` returns one dataset (or
None) per split: a ``GPTDataset`` for a single prefix, a ``BlendedDataset`` over several, mock data when the
config has no blend. Each component of a weighted blend gets ``ceil(ceil(n * w) * (1 + surplus))`` samples and
the blend draws from them in megatron-core's greedy order.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Sequence, Type

import numpy as np
import torch
import torch.distributed as dist

from longspan.config.schema.data import GPTDatasetConfig
from longspan.core.errors import DataError
from longspan.core.logging import get_logger, warn_rank_0
from longspan.data.indices import build_blending_indices, build_exhaustive_blending_indices
from longspan.data.utils import (
    Blend,
    Split,
    barrier_if_distributed,
    check_weights,
    dist_rank,
    normalize,
    parse_split,
    split_bounds,
    split_matrix,
)

logger = get_logger(__name__)


class BlendedDataset(torch.utils.data.Dataset):
    """Samples drawn from several datasets in proportion to their weights.

    Args:
        datasets: the component datasets (all of the same split).
        weights: their weights; with ``size`` None, integer sample counts to draw from each exhaustively.
        size: number of samples of the blend, or None for the exhaustive blend.
        config: the dataset config (``path_to_cache`` is read).
    """

    def __init__(self, datasets: Sequence[Any], weights: Sequence[float], size: Optional[int],
                 config: GPTDatasetConfig) -> None:
        if len(datasets) != len(weights) or not datasets:
            raise DataError(f"a blend needs one weight per dataset; got {len(datasets)} datasets, {len(weights)} weights")
        if len(datasets) >= 32767:
            raise DataError(f"a blend holds at most 32766 datasets; got {len(datasets)}")
        if not all(w > 0 for w in weights):
            raise DataError(f"blend weights must be > 0; got {list(weights)}")
        if size is not None:
            weights = normalize(weights)
        self.datasets = list(datasets)
        self.split = self.datasets[0].index_split
        self.weights = list(weights)
        self.size = size
        self.config = config
        ident: "OrderedDict[str, Any]" = OrderedDict()
        ident["class"] = type(self).__name__
        ident["datasets"] = [d.unique_identifiers for d in self.datasets]
        ident["split"] = self.split.name
        ident["weights"] = self.weights
        ident["size"] = self.size
        self.unique_identifiers = ident
        self.unique_description = json.dumps(ident, indent=4)
        self.unique_description_hash = hashlib.md5(self.unique_description.encode("utf-8")).hexdigest()
        self.dataset_index, self.dataset_sample_index = self._build_indices()

    def __len__(self) -> int:
        return int(self.dataset_index.shape[0])

    def __getitem__(self, idx: int) -> Dict[str, Any]:
        dataset_id = int(self.dataset_index[idx])
        sample_id = int(self.dataset_sample_index[idx])
        return {"dataset_id": dataset_id, **self.datasets[dataset_id][sample_id]}

    def _build_indices(self):
        cache_dir = self.config.path_to_cache
        paths = None
        if cache_dir:
            base = os.path.join(str(cache_dir), f"{self.unique_description_hash}-{type(self).__name__}-{self.split.name}")
            paths = {k: f"{base}-{k}.{ext}" for k, ext in
                     (("description", "txt"), ("dataset_index", "npy"), ("dataset_sample_index", "npy"))}
            if all(os.path.isfile(p) for p in paths.values()):
                return np.load(paths["dataset_index"], mmap_mode="r"), np.load(paths["dataset_sample_index"], mmap_mode="r")
        if self.size is not None:
            dataset_index, sample_index = build_blending_indices(np.asarray(self.weights), int(self.size))
        else:
            dataset_index, sample_index = build_exhaustive_blending_indices(np.asarray(self.weights, dtype=np.int64))
        counts = np.bincount(dataset_index.astype(np.int64), minlength=len(self.datasets))
        for i, (n, ds) in enumerate(zip(counts, self.datasets)):
            if n > len(ds):
                raise DataError(
                    f"the {self.split.name} blend takes {n} samples from dataset {i} "
                    f"({getattr(ds, 'dataset_path', None)}) which has {len(ds)}; raise "
                    f"dataset.mid_level_dataset_surplus (now {self.config.mid_level_dataset_surplus})"
                )
        if paths:
            try:
                os.makedirs(os.path.dirname(paths["description"]), exist_ok=True)
                for key, arr in (("dataset_index", dataset_index), ("dataset_sample_index", sample_index)):
                    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(paths[key]), suffix=".npy")
                    with os.fdopen(fd, "wb") as f:
                        np.save(f, arr, allow_pickle=False)
                    os.replace(tmp, paths[key])
                with open(paths["description"], "w") as f:
                    f.write(self.unique_description)
            except OSError as exc:
                logger.warning(f"could not cache the blend indices in {cache_dir}: {exc.strerror}")
        return dataset_index, sample_index


def sizes_per_dataset(weights: Sequence[float], sizes: Sequence[Optional[int]], surplus: float = 0.0) -> List[List[Optional[int]]]:
    """Samples to request from each component per split: ``ceil(ceil(size * w) * (1 + surplus))``."""
    return [
        [None if s is None else int(math.ceil(math.ceil(s * w) * (1 + surplus))) for s in sizes] for w in weights
    ]


class BlendedMegatronDatasetBuilder:
    """Builds the train/valid/test datasets of a config (megatron-core's builder API).

    Args:
        cls: the dataset class (``GPTDataset`` or ``MockGPTDataset``).
        sizes: the minimum number of samples per split (None: one epoch of that split).
        is_built_on_rank: returns whether this rank needs the datasets (others get None).
        config: the dataset config with ``blend`` / ``blend_per_split`` / ``split`` resolved (a ``data_path``
            string is resolved by ``longspan.data.loaders``).
    """

    def __init__(self, cls: Type, sizes: Sequence[Optional[int]], is_built_on_rank: Callable[[], bool],
                 config: GPTDatasetConfig) -> None:
        self.cls = cls
        self.sizes = list(sizes) + [None] * (3 - len(sizes))
        self.is_built_on_rank = is_built_on_rank
        self.config = config
        blend = config.blend
        per_split = config.blend_per_split
        if per_split is not None and not any(per_split):
            per_split = None
        if blend is not None and per_split is not None:
            raise DataError("dataset.blend and dataset.blend_per_split are both set; use one of them")
        self.blend: Optional[Blend] = self._clean_blend(blend, "dataset.blend") if blend is not None else None
        self.blend_per_split: Optional[List[Optional[Blend]]] = None
        if per_split is not None:
            if len(per_split) != 3:
                raise DataError(f"dataset.blend_per_split has {len(per_split)} entries; it needs 3 (train, valid, test)")
            self.blend_per_split = [
                None if b is None else self._clean_blend(b, f"dataset.blend_per_split[{i}]") for i, b in enumerate(per_split)
            ]
        self.mock = self.blend is None and self.blend_per_split is None
        if self.mock:
            split = "1,1,1"  # megatron-core's arbitrary even split for mock data
        else:
            split = config.split
            if self.blend is not None and split is None:
                raise DataError("dataset.split is required with a blend (for example '969,30,1')")
        self.split_matrix = split_matrix(parse_split(split)) if split is not None else None
        for i in range(3):
            blend_i = self.blend if self.blend_per_split is None else self.blend_per_split[i]
            if blend_i is not None and self.sizes[i] is None and blend_i[1] is not None:
                raise DataError(f"{Split(i).name} split: blend weights need a number of samples for that split")

    @staticmethod
    def _clean_blend(blend: Any, field: str) -> Blend:
        prefixes, weights = list(blend[0]), (None if blend[1] is None else [float(w) for w in blend[1]])
        if not prefixes:
            raise DataError(f"{field} has no dataset prefixes")
        if weights is not None:
            if len(weights) != len(prefixes):
                raise DataError(f"{field}: {len(prefixes)} prefixes but {len(weights)} weights")
            check_weights(weights, field)
            kept = [(p, w) for p, w in zip(prefixes, weights) if w > 0]
            if len(kept) < len(prefixes):
                warn_rank_0(f"{field}: dropping {len(prefixes) - len(kept)} prefix(es) with weight 0", logger)
            prefixes, weights = [p for p, _ in kept], [w for _, w in kept]
        return prefixes, weights

    def build(self) -> List[Optional[Any]]:
        """One dataset (or None) per split. Distributed-aware: call it on every rank."""
        if not (dist.is_available() and dist.is_initialized()):
            return self._build()
        # Rank 0 builds (and caches) first; the others then read its caches. An error on rank 0 still
        # reaches the barrier, and the other ranks meet the same error building for themselves.
        result: List[Optional[Any]] = [None, None, None]
        error: Optional[BaseException] = None
        if dist_rank() == 0:
            try:
                result = self._build()
            except BaseException as exc:  # re-raised after the barrier
                error = exc
        barrier_if_distributed()
        if error is not None:
            raise error
        if dist_rank() != 0:
            result = self._build()
        return result

    def _build(self) -> List[Optional[Any]]:
        if self.mock:
            return self._build_splits(None, self.split_matrix, self.sizes)
        if self.blend is not None:
            prefixes, weights = self.blend
            if len(prefixes) == 1 and weights is None:
                return self._build_splits(prefixes[0], self.split_matrix, self.sizes)
            return self._build_blend(prefixes, weights, self.split_matrix, self.sizes, range(3))
        out: List[Optional[Any]] = [None, None, None]
        for i in range(3):
            blend = self.blend_per_split[i]
            if blend is None:
                continue
            spoof: List[Optional[tuple]] = [None, None, None]
            spoof[i] = (0.0, 1.0)
            sizes = [0, 0, 0]
            sizes[i] = self.sizes[i]
            prefixes, weights = blend
            if len(prefixes) == 1:
                out[i] = self._build_splits(prefixes[0], spoof, sizes)[i]
            else:
                out[i] = self._build_blend(prefixes, weights, spoof, sizes, [i])[i]
        return out

    def _build_blend(self, prefixes, weights, matrix, sizes, splits) -> List[Optional[Any]]:
        if weights is not None:
            weights = normalize(weights)
            target = sizes_per_dataset(weights, sizes)
            surplus = float(self.config.mid_level_dataset_surplus)
            buffer = sizes_per_dataset(weights, sizes, surplus)
        else:
            buffer = [[None, None, None] for _ in prefixes]
        per_prefix = [self._build_splits(p, matrix, buffer[j]) for j, p in enumerate(prefixes)]
        out: List[Optional[Any]] = [None, None, None]
        for i in splits:
            if matrix[i] is None or not self.is_built_on_rank():
                continue
            datasets = [per_prefix[j][i] for j in range(len(prefixes))]
            if weights is not None:
                w_i, size_i = weights, sum(target[j][i] for j in range(len(prefixes)))
            else:
                w_i = [len(d) for d in datasets]
                size_i = None if sizes[i] is None else min(sizes[i], sum(w_i))
            out[i] = BlendedDataset(datasets, w_i, size_i, self.config)
        return out

    def _build_splits(self, path: Optional[str], matrix, sizes) -> List[Optional[Any]]:
        if not self.is_built_on_rank():
            return [None, None, None]
        low = self.cls.build_low_level_dataset(path, self.config)
        n = self.cls.numel_low_level_dataset(low)
        out: List[Optional[Any]] = []
        for i, split in enumerate(Split):
            if matrix[i] is None:
                out.append(None)
                continue
            beg, end = split_bounds(matrix[i], n)
            indices = np.arange(beg, end, dtype=np.int32)
            out.append(self.cls(low, path, indices, sizes[i], split, self.config))
        return out
