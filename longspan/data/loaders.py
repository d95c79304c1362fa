"""Datasets and data iterators of a training run (Megatron's sizes, samplers and iterator kinds).

The iterators' position is the checkpoint's ``consumed_train_samples`` / ``consumed_valid_samples``: a resumed
run rebuilds them from those numbers and continues with exactly the samples it would have seen.
"""

from __future__ import annotations

import copy
import functools
import math
import signal
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple

import torch

from longspan.config.schema.container import ConfigContainer
from longspan.config.schema.data import FinetuningDatasetConfig, GPTDatasetConfig, T5MaskedWordPieceDatasetConfig
from longspan.config.schema.data_hf import DirectHFSFTDatasetConfig
from longspan.core.errors import ConfigError, DataError
from longspan.core.logging import get_logger, warn_rank_0
from longspan.core.model_parallel_config import ModelParallelConfig
from longspan.data.blended import BlendedMegatronDatasetBuilder
from longspan.data.builtin import prepare_builtin_corpus
from longspan.data.gpt_dataset import GPTDataset, MockGPTDataset
from longspan.data.samplers import MegatronPretrainingRandomSampler, MegatronPretrainingSampler
from longspan.data.sft.dataset import build_sft_datasets
from longspan.data.sft.hf_dataset import build_direct_hf_sft_datasets
from longspan.data.sft.formatting import SFTFormatOptions, parse_format_options, resolve_padding
from longspan.data.sft.multimodal import processor_for_tokenizer
from longspan.data.t5_dataset import T5_SAMPLE_KEYS, T5MaskedWordPieceDataset
from longspan.data.utils import Blend, parse_blend_string
from longspan.models.t5_provider import T5ModelProvider

logger = get_logger(__name__)

SAMPLE_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "attention_mask")
DEFAULT_SPLIT = "969,30,1"  # Megatron-LM's default when a data path comes without a split


def resolve_data_path(data_path: str, tokenizer: Any) -> Blend:
    """``"PREFIX"``, ``"W1 P1 W2 P2"`` or ``"builtin:NAME"`` -> (prefixes, weights or None).

    ``builtin:`` entries are prepared (tokenized with ``tokenizer`` and cached) on first use.
    """
    prefixes, weights = parse_blend_string(data_path)
    resolved = []
    for p in prefixes:
        if p.startswith("builtin:"):
            p = prepare_builtin_corpus(p, tokenizer)
        resolved.append(p)
    return resolved, weights


def get_train_valid_test_num_samples(cfg: ConfigContainer) -> Tuple[int, int, int]:
    """Samples per split, as Megatron computes them.

    train = train_samples or train_iters * global_batch_size; valid = (train_iters // eval_interval + 1) *
    eval_iters * global_batch_size; test = eval_iters * global_batch_size.
    """
    t = cfg.train
    gbs = int(t.global_batch_size)
    train_iters = t.train_iters
    train_samples = t.train_samples
    if train_samples:
        train = int(train_samples)
        if not train_iters:
            train_iters = train // gbs
    else:
        train = int(train_iters or 0) * gbs
    eval_iters = int(t.eval_iters or 0)
    eval_interval = t.eval_interval
    evals = (int(train_iters or 0) // int(eval_interval) + 1) if eval_interval else 1
    return train, evals * eval_iters * gbs, eval_iters * gbs


def resolve_dataset_config(dataset_cfg: GPTDatasetConfig, tokenizer: Any) -> GPTDatasetConfig:
    """A copy of the dataset config with ``tokenizer`` set and ``data_path`` turned into ``blend``."""
    cfg = copy.copy(dataset_cfg)
    cfg.tokenizer = tokenizer
    if dataset_cfg.data_path is not None:
        if dataset_cfg.blend is not None:
            raise DataError("dataset.data_path and dataset.blend are both set: use one of them")
        cfg.blend = resolve_data_path(dataset_cfg.data_path, tokenizer)
    if cfg.mock:
        cfg.blend, cfg.blend_per_split = None, None
    if cfg.blend is not None and cfg.split is None:
        cfg.split = DEFAULT_SPLIT
    return cfg


def _is_mock(cfg: GPTDatasetConfig) -> bool:
    per_split = cfg.blend_per_split
    return cfg.blend is None and (per_split is None or not any(per_split))


def _chat_template(cfg: ConfigContainer) -> Optional[str]:
    """The tokenizer config's chat template (None without a tokenizer section)."""
    return cfg.tokenizer.chat_template if cfg.tokenizer is not None else None


def build_train_valid_test_datasets(cfg: ConfigContainer, tokenizer: Any) -> List[Optional[Any]]:
    """[train, valid, test] datasets of a ConfigContainer (None for a split that is not built)."""
    if is_direct_hf_sft_dataset(cfg.dataset):
        return build_direct_hf_sft_datasets(cfg.dataset, tokenizer, get_train_valid_test_num_samples(cfg),
                                            int(cfg.dataset.seq_length), _chat_template(cfg))
    if is_finetuning_dataset(cfg.dataset):
        return _build_finetuning_datasets(cfg, tokenizer)
    ds_cfg = resolve_dataset_config(cfg.dataset, tokenizer)
    model = cfg.model
    model_seq = model.seq_length if model is not None else None
    if model_seq is not None and ds_cfg.sequence_length > model_seq:
        raise DataError(
            f"dataset.sequence_length={ds_cfg.sequence_length} is longer than model.seq_length={model_seq}: "
            f"the model cannot take such samples; set both the same"
        )
    if tokenizer is not None and getattr(tokenizer, "eod", None) is None:
        warn_rank_0("the tokenizer has no end-of-document token: eod_mask_loss and the resets have no effect", logger)
    sizes = get_train_valid_test_num_samples(cfg)
    if is_t5_dataset(ds_cfg):
        _check_t5_dataset(ds_cfg, model)
        return BlendedMegatronDatasetBuilder(T5MaskedWordPieceDataset, list(sizes), lambda: True, ds_cfg).build()
    cls = MockGPTDataset if _is_mock(ds_cfg) else GPTDataset
    return BlendedMegatronDatasetBuilder(cls, list(sizes), lambda: True, ds_cfg).build()


def is_t5_dataset(dataset_cfg: Any) -> bool:
    """True for a T5MaskedWordPieceDatasetConfig (span corruption, longspan.data.t5_dataset)."""
    return isinstance(dataset_cfg, T5MaskedWordPieceDatasetConfig)


def _check_t5_dataset(ds_cfg: T5MaskedWordPieceDatasetConfig, model: Optional[ModelParallelConfig]) -> None:
    """T5 data needs files, a T5 model of matching decoder length, and none of the GPT-only switches."""
    if _is_mock(ds_cfg):
        raise DataError("T5MaskedWordPieceDatasetConfig needs data (dataset.data_path or dataset.blend); "
                        "mock data is not supported")
    gpt_only = {"reset_position_ids": ds_cfg.reset_position_ids, "reset_attention_mask": ds_cfg.reset_attention_mask,
                "eod_mask_loss": ds_cfg.eod_mask_loss}
    for name, value in gpt_only.items():
        if value:
            raise DataError(f"dataset.{name}={value!r} does not apply to T5 data: leave it unset")
    dec = model.seq_length_dec if isinstance(model, T5ModelProvider) else None
    if model is not None and dec is None:
        raise DataError(f"T5MaskedWordPieceDatasetConfig needs a T5 model (T5ModelProvider), not {type(model).__name__}")
    if dec is not None and dec != ds_cfg.sequence_length_decoder:
        raise DataError(f"dataset.sequence_length_decoder={ds_cfg.sequence_length_decoder} differs from "
                        f"model.seq_length_dec={dec}: set both the same")


def is_direct_hf_sft_dataset(dataset_cfg: Any) -> bool:
    """True for a DirectHFSFTDatasetConfig (files read through ``datasets``, longspan.data.sft.hf_dataset)."""
    return isinstance(dataset_cfg, DirectHFSFTDatasetConfig)


def is_finetuning_dataset(dataset_cfg: Any) -> bool:
    """True for a FinetuningDatasetConfig (SFT JSONL data under ``dataset_root``)."""
    return isinstance(dataset_cfg, FinetuningDatasetConfig)


def _build_finetuning_datasets(cfg: ConfigContainer, tokenizer: Any) -> List[Optional[Any]]:
    d = cfg.dataset
    model_seq = cfg.model.seq_length if cfg.model is not None else None
    seq_length = d.seq_length if d.seq_length is not None else model_seq
    if seq_length is None:
        raise DataError("dataset.seq_length and model.seq_length are both unset: set the sequence length")
    opts = sft_padding(d, cfg.model)
    return build_sft_datasets(d, tokenizer, get_train_valid_test_num_samples(cfg), int(seq_length),
                              _chat_template(cfg), processor_for_tokenizer(tokenizer), opts=opts)


def sft_padding(dataset_cfg: FinetuningDatasetConfig, model: Optional[ModelParallelConfig]) -> SFTFormatOptions:
    """The formatting options with the microbatch padding decided for the layout: to the longest sample unless
    pipeline parallel needs fixed shapes (``resolve_padding``); a padding the layout cannot run is one line."""
    opts = parse_format_options(dataset_cfg.dataset_kwargs)
    layout = model if model is not None else ModelParallelConfig()  # no model section: a single device
    pp = int(layout.pipeline_model_parallel_size or 1)
    cp = int(layout.context_parallel_size or 1)
    tp = int(layout.tensor_model_parallel_size or 1)
    sp = bool(layout.sequence_parallel) and tp > 1
    # context parallel cuts sequences into 2 x cp chunks; sequence parallel splits them over tp
    multiple = math.lcm(2 * cp if cp > 1 else 1, tp if sp else 1)
    opts = resolve_padding(opts, dataset_cfg.dataset_kwargs, fixed_shapes=pp > 1, multiple=multiple)
    if opts.pad_to_max_length:
        return opts
    if pp > 1:
        raise ConfigError(
            "dataset.dataset_kwargs.pad_to_max_length=False with pipeline_model_parallel_size>1: pipeline stages "
            "exchange activations of a fixed length; set pad_to_max_length to True or leave it unset"
        )
    if opts.pad_seq_length_to_mult % multiple:
        raise ConfigError(
            f"dataset.dataset_kwargs.pad_seq_length_to_mult={opts.pad_seq_length_to_mult} must be a multiple of "
            f"{multiple} (2 x context_parallel_size={cp}, tensor_model_parallel_size={tp} with sequence_parallel) "
            "when pad_to_max_length=False"
        )
    return opts


def collate_samples(samples: List[Dict[str, Any]]) -> Dict[str, torch.Tensor]:
    """Stack the samples of a micro-batch (GPT keys, or the T5 keys for T5 samples)."""
    out: Dict[str, torch.Tensor] = {}
    for key in T5_SAMPLE_KEYS if "text_enc" in samples[0] else SAMPLE_KEYS:
        if key in samples[0]:
            out[key] = torch.stack([s[key] for s in samples])
    return out


def cyclic_iter(iterable: Iterable) -> Iterator:
    """Iterate ``iterable`` again and again."""
    while True:
        empty = True
        for x in iterable:
            empty = False
            yield x
        if empty:
            return


def _record_exit_signal(signum: int, frame: Any) -> None:
    """A worker's handler: the signal is the main process's to act on (it saves, then ends the workers)."""


def keep_workers_through_exit_signal(exit_signal: int, worker_id: int) -> None:
    """``worker_init_fn`` of ``train.exit_signal_handler_for_dataloader``: a signal sent to the whole process
    group (a scheduler's SIGTERM) must not end the data workers while the main process still saves a checkpoint
    with batches in flight, so each worker installs a handler that only records it (as Megatron's workers do)."""
    signal.signal(exit_signal, _record_exit_signal)


def build_pretraining_data_loader(
    dataset: Any,
    consumed_samples: int,
    dataloader_type: str,
    micro_batch_size: int,
    num_workers: int,
    data_sharding: bool,
    dp_rank: int = 0,
    dp_size: int = 1,
    pin_memory: bool = False,
    persistent_workers: bool = False,
    worker_exit_signal: Optional[int] = None,
) -> Optional[Any]:
    """A DataLoader over ``dataset`` with Megatron's sampler for ``dataloader_type`` ('external' passes through);
    with ``worker_exit_signal`` its workers keep running when that signal arrives
    (``keep_workers_through_exit_signal``)."""
    if dataset is None:
        return None
    if dataloader_type == "external":
        return dataset
    if dataloader_type == "single":
        sampler: Any = MegatronPretrainingSampler(len(dataset), consumed_samples, micro_batch_size, dp_rank, dp_size)
    elif dataloader_type == "cyclic":
        sampler = MegatronPretrainingRandomSampler(
            dataset, len(dataset), consumed_samples, micro_batch_size, dp_rank, dp_size, data_sharding
        )
    else:
        raise DataError(f"dataset.dataloader_type={dataloader_type!r} is not valid; use single, cyclic or external")
    return torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        pin_memory=bool(pin_memory) and torch.cuda.is_available(),
        persistent_workers=bool(persistent_workers) and num_workers > 0,
        worker_init_fn=(functools.partial(keep_workers_through_exit_signal, int(worker_exit_signal))
                        if worker_exit_signal is not None and num_workers > 0 else None),
        collate_fn=getattr(dataset, "collate_fn", collate_samples),
        # Its own generator: creating an iterator draws a worker base seed, which must not come from torch's
        # global generator (a validation iterator first used after a resume would shift the dropout stream).
        generator=torch.Generator().manual_seed(0),
    )


def build_train_valid_test_data_iterators(
    cfg: ConfigContainer, train_state: Any, tokenizer: Any, dp_rank: int = 0, dp_size: int = 1,
    datasets_out: Optional[List[Any]] = None,
) -> Tuple[Optional[Iterator], Optional[Iterator], Optional[Iterator]]:
    """(train, valid, test) iterators of micro-batches for this data-parallel rank.

    Each yields dicts of CPU tensors with a leading micro_batch_size dimension. Training starts at
    ``train_state.consumed_train_samples``; validation at ``consumed_valid_samples`` (0 with skip_train) and,
    as in Megatron, cycles; so does test. ``datasets_out``, when given, receives the three datasets.
    """
    t, d = cfg.train, cfg.dataset
    dl_type = d.dataloader_type or "single"
    train_ds, valid_ds, test_ds = build_train_valid_test_datasets(cfg, tokenizer)
    if datasets_out is not None:
        datasets_out[:] = [train_ds, valid_ds, test_ds]
    mbs = int(t.micro_batch_size)
    kwargs = dict(
        micro_batch_size=mbs,
        num_workers=int(d.num_workers or 0),
        data_sharding=bool(d.data_sharding),
        dp_rank=dp_rank,
        dp_size=dp_size,
        pin_memory=bool(d.pin_memory),
        persistent_workers=bool(d.persistent_workers),
        worker_exit_signal=(t.exit_signal or signal.SIGTERM) if t.exit_signal_handler_for_dataloader else None,
    )
    skip_train = bool(t.skip_train)
    train_consumed = int(train_state.consumed_train_samples or 0)
    valid_consumed = 0 if skip_train else int(train_state.consumed_valid_samples or 0)

    train_it = None
    if train_ds is not None and len(train_ds) > 0 and not skip_train:
        if dl_type == "single" and train_consumed >= len(train_ds):
            warn_rank_0(f"all {len(train_ds)} training samples were consumed; no training data left", logger)
        else:
            loader = build_pretraining_data_loader(train_ds, train_consumed, dl_type, **kwargs)
            train_it = loader if dl_type == "external" else iter(loader) if dl_type == "single" else iter(cyclic_iter(loader))

    def eval_iterator(ds: Any, consumed: int) -> Optional[Iterator]:
        if ds is None or len(ds) == 0:
            return None
        if dl_type == "external":
            return ds
        if dl_type == "single":
            # Validation wraps around; a position past the end starts the next pass.
            step = mbs * dp_size
            consumed = consumed % (len(ds) // step * step) if len(ds) >= step else 0
        loader = build_pretraining_data_loader(ds, consumed, dl_type, **kwargs)
        return iter(cyclic_iter(loader))

    valid_it = eval_iterator(valid_ds, valid_consumed)
    test_it = eval_iterator(test_ds, 0)
    return train_it, valid_it, test_it
