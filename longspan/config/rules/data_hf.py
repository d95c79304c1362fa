"""Rules of the direct HF SFT data (``DirectHFSFTDatasetConfig``): sources, blend weights, preprocessing and
the sample length. The data files themselves are read (and their rows checked) when the datasets are built,
before the first step."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from longspan.config.schema.data_hf import (
    LOSS_MODES,
    SCHEMA_ADAPTERS,
    ChatSFTPreprocessingConfig,
    DirectHFSFTDatasetConfig,
    HFDatasetSourceConfig,
)
from longspan.core.errors import ConfigError, NotSupportedError

if TYPE_CHECKING:
    from longspan.config.schema.container import ConfigContainer

# load_dataset arguments the source's own fields set
_SOURCE_OWNED_LOAD_KWARGS = ("path", "name", "split")


def _has_empty_path(value: Any) -> bool:
    if value is None:
        return True
    if isinstance(value, str):
        return not value.strip()
    if isinstance(value, (list, tuple)):
        return not value or any(_has_empty_path(v) for v in value)
    if isinstance(value, dict):
        return not value or any(_has_empty_path(v) for v in value.values())
    return True


def check_hf_source(source: Any, where: str) -> None:
    """One source: exactly one of dataset_name / path_or_dataset, well-formed split, subset, kwargs, adapter."""
    if not isinstance(source, HFDatasetSourceConfig):
        raise ConfigError(f"{where} is a {type(source).__name__}: expected an HFDatasetSourceConfig mapping")
    if source.dataset_name is not None:
        raise NotSupportedError(
            f"{where}.dataset_name={source.dataset_name!r}: Megatron Bridge's named dataset presets are not "
            "supported yet by longspan; give the data with path_or_dataset (a local file or directory)"
        )
    if not isinstance(source.path_or_dataset, str) or not source.path_or_dataset.strip():
        raise ConfigError(f"{where}.path_or_dataset={source.path_or_dataset!r}: give a file, directory or dataset name")
    if source.split is not None and not source.split.strip():
        raise ConfigError(f"{where}.split={source.split!r} is empty: give a split name such as 'train' or null")
    subset = source.subset
    if subset is not None and (
        (isinstance(subset, str) and not subset.strip())
        or (isinstance(subset, list) and (not subset or not all(isinstance(s, str) and s.strip() for s in subset)))
    ):
        raise ConfigError(f"{where}.subset={subset!r}: give a configuration name, a non-empty list of them, or null")
    load_kwargs = source.load_kwargs or {}
    owned = sorted(set(_SOURCE_OWNED_LOAD_KWARGS) & set(load_kwargs))
    if owned:
        raise ConfigError(f"{where}.load_kwargs sets {owned}: use the source's path_or_dataset, subset and split")
    if "data_files" in load_kwargs and _has_empty_path(load_kwargs["data_files"]):
        raise ConfigError(f"{where}.load_kwargs.data_files={load_kwargs['data_files']!r} must name non-empty paths")
    if source.schema_adapter is not None and source.schema_adapter not in SCHEMA_ADAPTERS:
        raise ConfigError(
            f"{where}.schema_adapter={source.schema_adapter!r} is not known: use one of {', '.join(SCHEMA_ADAPTERS)} "
            "or null (detected from the columns)"
        )


def _check_blend(d: DirectHFSFTDatasetConfig) -> None:
    sources = d.training_sources
    if not sources:
        raise ConfigError("dataset.source=[] names no data: give one source or a list of them")
    if d.source_weights is not None:
        if len(d.source_weights) != len(sources):
            raise ConfigError(
                f"dataset.source_weights has {len(d.source_weights)} weight(s) for {len(sources)} source(s): "
                "give one per source"
            )
        for w in d.source_weights:
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w <= 0:
                raise ConfigError(f"dataset.source_weights={d.source_weights!r}: weights must be positive numbers")
    if len(sources) > 1 and d.do_validation and d.validation_source is None:
        raise ConfigError(
            "dataset.source blends several sources, so there is no single 'validation' split to read: set "
            "dataset.validation_source or dataset.do_validation=False"
        )


def _check_processor(d: DirectHFSFTDatasetConfig) -> None:
    """hf_processor_kwargs only with hf_processor_path, which must be a non-empty path."""
    path = d.hf_processor_path
    if path is not None and (not isinstance(path, str) or not path.strip()):
        raise ConfigError(f"dataset.hf_processor_path={path!r}: give the model directory holding the HF processor")
    if d.hf_processor_kwargs is not None and path is None:
        raise ConfigError(f"dataset.hf_processor_kwargs={d.hf_processor_kwargs!r} is set without "
                          "dataset.hf_processor_path: set the processor's directory too, or drop the kwargs")
    if d.hf_processor_kwargs is not None and not isinstance(d.hf_processor_kwargs, dict):
        raise ConfigError(f"dataset.hf_processor_kwargs={d.hf_processor_kwargs!r} must be a mapping of "
                          "AutoProcessor.from_pretrained arguments")


#: the one in-batch packing left out for image data (the data layer refuses it too, for a dataset built alone)
DEFERRED_IMAGE_PACKING = ("dataset.defer_in_batch_packing_to_step=True with dataset.hf_processor_path is not supported "
                          "yet: the training step packs text batches only; set it False (the collate function packs "
                          "image batches)")


def _check_in_batch_packing(cfg: "ConfigContainer") -> None:
    """In-batch packing: its companion fields only with it; with it, microbatches of several samples, no fixed
    width, and the layouts its variable-width packs are built for (no pipeline or context parallel)."""
    d, m = cfg.dataset, cfg.model
    multiple = d.in_batch_packing_pad_to_multiple_of
    if isinstance(multiple, bool) or not isinstance(multiple, int) or multiple < 1:
        raise ConfigError(f"dataset.in_batch_packing_pad_to_multiple_of={multiple!r} must be an integer >= 1")
    if not d.enable_in_batch_packing:
        for name, value, default in (("defer_in_batch_packing_to_step", d.defer_in_batch_packing_to_step, False),
                                     ("in_batch_packing_pad_to_multiple_of", multiple, 1)):
            if value != default:
                raise ConfigError(f"dataset.{name}={value!r} is set without dataset.enable_in_batch_packing=True: "
                                  "enable the packing or leave it at its default")
        return
    mbs = int(cfg.train.micro_batch_size or 1)
    if mbs < 2:
        raise ConfigError(f"dataset.enable_in_batch_packing=True with train.micro_batch_size={mbs}: packing joins the "
                          "samples of a microbatch, set micro_batch_size >= 2")
    if d.pad_to_max_length:
        raise ConfigError("dataset.pad_to_max_length=True with dataset.enable_in_batch_packing=True: a packed "
                          "microbatch is as wide as its padded samples; set pad_to_max_length=False")
    for name, why in (("pipeline_model_parallel_size", "pipeline stages exchange activations of a fixed shape"),
                      ("context_parallel_size", "context parallel over variable-width packs is not built")):
        size = int(getattr(m, name, 1) or 1)
        if size > 1:
            raise NotSupportedError(f"dataset.enable_in_batch_packing=True with model.{name}={size}: {why}; "
                                    "turn one of them off")
    tp = int(m.tensor_model_parallel_size or 1)
    if bool(m.sequence_parallel) and tp > 1 and multiple % tp:
        raise ConfigError(f"dataset.in_batch_packing_pad_to_multiple_of={multiple} must be a multiple of "
                          f"tensor_model_parallel_size={tp} with sequence_parallel (the pack is split over its ranks)")


def check_direct_hf_sft(cfg: "ConfigContainer") -> None:
    """Direct HF SFT data: its sources, blend, preprocessing and lengths against the model."""
    d = cfg.dataset
    if not isinstance(d, DirectHFSFTDatasetConfig):
        return
    m = cfg.model
    if d.seq_length <= 0:
        raise ConfigError(f"dataset.seq_length={d.seq_length} must be positive")
    if m.seq_length is not None and d.seq_length != m.seq_length:
        raise ConfigError(
            f"dataset.seq_length={d.seq_length} differs from model.seq_length={m.seq_length}: set both the same"
        )
    _check_blend(d)
    for i, source in enumerate(d.training_sources):
        check_hf_source(source, "dataset.source" if not isinstance(d.source, list) else f"dataset.source[{i}]")
    for name in ("validation_source", "test_source"):
        if getattr(d, name) is not None:
            check_hf_source(getattr(d, name), f"dataset.{name}")
    if not isinstance(d.preprocessing, ChatSFTPreprocessingConfig):
        raise NotSupportedError(
            f"dataset.preprocessing={type(d.preprocessing).__name__} is not supported yet by longspan: use "
            "ChatSFTPreprocessingConfig (prompt/completion rows are read as a user turn and an assistant turn)"
        )
    if d.preprocessing.loss_mode not in LOSS_MODES:
        raise ConfigError(
            f"dataset.preprocessing.loss_mode={d.preprocessing.loss_mode!r} is not valid: choose one of "
            f"{', '.join(LOSS_MODES)}"
        )
    if d.pad_to_multiple_of < 1:
        raise ConfigError(f"dataset.pad_to_multiple_of={d.pad_to_multiple_of} must be an integer >= 1")
    _check_processor(d)
    _check_in_batch_packing(cfg)
    if d.enable_in_batch_packing and d.defer_in_batch_packing_to_step and d.hf_processor_path is not None:
        raise NotSupportedError(DEFERRED_IMAGE_PACKING)
    if not d.pad_to_max_length and int(m.pipeline_model_parallel_size or 1) > 1:
        raise ConfigError(
            "dataset.pad_to_max_length=False with pipeline_model_parallel_size>1: pipeline stages exchange "
            "activations of a fixed length; set dataset.pad_to_max_length=True"
        )
    if not d.pad_to_max_length:
        cp = int(m.context_parallel_size or 1)
        tp = int(m.tensor_model_parallel_size or 1)
        sp = bool(m.sequence_parallel) and tp > 1
        # context parallel cuts sequences into 2 x cp chunks; sequence parallel splits them over tp
        multiple = math.lcm(2 * cp if cp > 1 else 1, tp if sp else 1)
        if d.pad_to_multiple_of % multiple or d.seq_length % multiple:
            raise ConfigError(
                f"dataset.pad_to_multiple_of={d.pad_to_multiple_of} and dataset.seq_length={d.seq_length} must be "
                f"multiples of {multiple} (2 x context_parallel_size={cp}, tensor_model_parallel_size={tp} with "
                "sequence_parallel) when pad_to_max_length=False"
            )
