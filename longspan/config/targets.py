"""The ``_target_`` allowlist: the only names a config file may refer to.

Nothing named in a file is ever imported or called. A ``_target_`` is looked up in these tables; longspan
config classes are constructed with the file's values, known dtypes and activation functions are returned as
objects, and everything else is an error. Megatron Bridge and Megatron Core names map onto longspan's.

The tables name longspan's classes and functions by dotted path, resolved with importlib when a file is loaded
or a container is validated (as Hydra resolves ``_target_``): the model providers and PEFT configs live in
packages above ``config``, which this package never imports.
"""

from __future__ import annotations

import functools
import importlib
import re
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from longspan.core.errors import ConfigError

DTYPES: dict[str, torch.dtype] = {
    "torch.float32": torch.float32,
    "torch.float": torch.float32,
    "torch.bfloat16": torch.bfloat16,
    "torch.float16": torch.float16,
    "torch.half": torch.float16,
}
# Short spellings accepted on the command line (model.params_dtype=bf16).
DTYPE_ALIASES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}

# Allowlisted functions: the object, or the dotted path of a longspan function (resolved on first use).
CALLABLES: dict[str, Any] = {
    "torch.nn.functional.gelu": F.gelu,
    "torch.nn.functional.silu": F.silu,
    "torch.nn.functional.relu": F.relu,
    "torch.nn.functional.tanh": torch.tanh,
    "torch.tanh": torch.tanh,
    "torch.sigmoid": torch.sigmoid,
    "torch.nn.functional.sigmoid": torch.sigmoid,
    "longspan.models.activations.gelu_tanh": "longspan.models.activations.gelu_tanh",
    "longspan.models.activations.squared_relu": "longspan.models.activations.squared_relu",
    "longspan.models.activations.quick_gelu": "longspan.models.activations.quick_gelu",
}
CALLABLE_ALIASES: dict[str, str] = {
    "gelu": "torch.nn.functional.gelu", "silu": "torch.nn.functional.silu", "swish": "torch.nn.functional.silu",
    "relu": "torch.nn.functional.relu", "tanh": "torch.tanh", "sigmoid": "torch.sigmoid",
    "F.gelu": "torch.nn.functional.gelu", "F.silu": "torch.nn.functional.silu", "F.relu": "torch.nn.functional.relu",
    "gelu_tanh": "longspan.models.activations.gelu_tanh", "openai_gelu": "longspan.models.activations.gelu_tanh",
    "squared_relu": "longspan.models.activations.squared_relu",
    "megatron.core.activations.squared_relu": "longspan.models.activations.squared_relu",
    "quick_gelu": "longspan.models.activations.quick_gelu",
    "megatron.core.fusions.fused_bias_geglu.quick_gelu": "longspan.models.activations.quick_gelu",
}

# Canonical (longspan) names of the config classes, used in the YAML that longspan writes.
_LONGSPAN_CLASSES = {
    "longspan.training.config": [
        "ConfigContainer", "RNGConfig", "DistributedInitConfig", "RerunStateMachineConfig", "DataloaderConfig",
        "GPTDatasetConfig", "MockGPTDatasetConfig", "FinetuningDatasetConfig", "SchedulerConfig",
        "T5MaskedWordPieceDatasetConfig",
        "TrainingConfig", "CheckpointConfig", "LoggerConfig", "ProfilingConfig", "FaultToleranceConfig",
        "StragglerDetectionConfig", "NVRxStragglerDetectionConfig", "InProcessRestartConfig", "OptimizerConfig",
        "DistributedDataParallelConfig", "TokenizerConfig", "MixedPrecisionConfig", "PackedSequenceSpecs",
        "DirectHFSFTDatasetConfig", "HFDatasetSourceConfig", "ChatSFTPreprocessingConfig",
    ],
    "longspan.models": ["GPTModelProvider", "T5ModelProvider", "MambaProvider", "Qwen25VLModelProvider"],
    "longspan.peft": ["LoRA", "DoRA", "CanonicalLoRA"],
}

# Megatron Bridge / Megatron Core names -> longspan class name.
_FOREIGN_CLASSES: dict[str, str] = {
    "megatron.core.optimizer.OptimizerConfig": "OptimizerConfig",
    "megatron.core.optimizer.optimizer_config.OptimizerConfig": "OptimizerConfig",
    "megatron.core.distributed.DistributedDataParallelConfig": "DistributedDataParallelConfig",
    "megatron.core.distributed.distributed_data_parallel_config.DistributedDataParallelConfig":
        "DistributedDataParallelConfig",
    "megatron.bridge.training.tokenizers.config.TokenizerConfig": "TokenizerConfig",
    "megatron.training.config.TokenizerConfig": "TokenizerConfig",
    "megatron.bridge.training.mixed_precision.MixedPrecisionConfig": "MixedPrecisionConfig",
    "megatron.bridge.data.base.DataloaderConfig": "DataloaderConfig",
    "megatron.bridge.data.builders.gpt_sft.FinetuningDatasetConfig": "FinetuningDatasetConfig",
    "megatron.bridge.data.datasets.packed_sequence.PackedSequenceSpecs": "PackedSequenceSpecs",
    "megatron.bridge.data.packing.PackedSequenceSpecs": "PackedSequenceSpecs",
    "megatron.core.datasets.gpt_dataset.GPTDatasetConfig": "GPTDatasetConfig",
    # Direct HF SFT data: the paths Bridge's modules define these classes at and its tutorials import them from.
    "megatron.bridge.data.builders.direct_hf_sft.DirectHFSFTDatasetConfig": "DirectHFSFTDatasetConfig",
    "megatron.bridge.data.builders.DirectHFSFTDatasetConfig": "DirectHFSFTDatasetConfig",
    "megatron.bridge.data.sources.hf.HFDatasetSourceConfig": "HFDatasetSourceConfig",
    "megatron.bridge.data.sources.HFDatasetSourceConfig": "HFDatasetSourceConfig",
    "megatron.bridge.data.hf_source.HFDatasetSourceConfig": "HFDatasetSourceConfig",
    "megatron.bridge.data.builders.HFDatasetSourceConfig": "HFDatasetSourceConfig",
    "megatron.bridge.data.builders.direct_hf_sft.HFDatasetSourceConfig": "HFDatasetSourceConfig",
    "megatron.bridge.data.sft_processing.ChatSFTPreprocessingConfig": "ChatSFTPreprocessingConfig",
    "megatron.bridge.data.builders.direct_hf_sft.ChatSFTPreprocessingConfig": "ChatSFTPreprocessingConfig",
    "megatron.core.datasets.t5_dataset.T5MaskedWordPieceDatasetConfig": "T5MaskedWordPieceDatasetConfig",
    "megatron.bridge.models.gpt_provider.GPTModelProvider": "GPTModelProvider",
    "megatron.bridge.models.GPTModelProvider": "GPTModelProvider",
    "megatron.bridge.models.T5ModelProvider": "T5ModelProvider",
    "megatron.bridge.models.t5_provider.T5ModelProvider": "T5ModelProvider",
    "megatron.bridge.models.mamba.mamba_provider.MambaProvider": "MambaProvider",
    "megatron.bridge.models.MambaProvider": "MambaProvider",
    "megatron.bridge.models.qwen_vl.qwen25_vl_provider.Qwen25VLModelProvider": "Qwen25VLModelProvider",
    "megatron.bridge.models.qwen_vl.Qwen25VLModelProvider": "Qwen25VLModelProvider",
    "megatron.bridge.models.Qwen25VLModelProvider": "Qwen25VLModelProvider",
    "megatron.bridge.peft.lora.LoRA": "LoRA",
    "megatron.bridge.peft.lora.lora.LoRA": "LoRA",
    "megatron.bridge.peft.dora.DoRA": "DoRA",
    "megatron.bridge.peft.lora.dora.DoRA": "DoRA",
    "megatron.bridge.peft.canonical_lora.CanonicalLoRA": "CanonicalLoRA",
    "megatron.bridge.peft.lora.canonical_lora.CanonicalLoRA": "CanonicalLoRA",
}
for _name in _LONGSPAN_CLASSES["longspan.training.config"]:
    _FOREIGN_CLASSES.setdefault(f"megatron.bridge.training.config.{_name}", _name)
    _FOREIGN_CLASSES.setdefault(f"megatron.training.config.{_name}", _name)

# Model providers of particular Bridge model families (Llama3ModelProvider8B, Qwen3ModelProvider, ...) are GPT
# models whose run_config lists every field, so they load as GPTModelProvider.
_BRIDGE_PROVIDER = re.compile(r"^megatron\.bridge\.models\.[A-Za-z0-9_.]*\.([A-Za-z0-9_]*Provider[A-Za-z0-9_]*)$")


def longspan_target(cls: type) -> str:
    """The ``_target_`` longspan writes for one of its config classes."""
    for module, names in _LONGSPAN_CLASSES.items():
        if cls.__name__ in names:
            return f"{module}.{cls.__name__}"
    raise ConfigError(f"{cls.__name__} is not a longspan config class")


_SCHEMA = "longspan.config.schema"

# Where every config class a file may name is defined (dotted paths, imported on first use).
CONFIG_CLASSES: dict[str, str] = {
    "ConfigContainer": f"{_SCHEMA}.container.ConfigContainer",
    **{name: f"{_SCHEMA}.data.{name}" for name in (
        "DataloaderConfig", "GPTDatasetConfig", "MockGPTDatasetConfig", "T5MaskedWordPieceDatasetConfig",
        "FinetuningDatasetConfig", "TokenizerConfig", "PackedSequenceSpecs")},
    **{name: f"{_SCHEMA}.data_hf.{name}" for name in (
        "DirectHFSFTDatasetConfig", "HFDatasetSourceConfig", "ChatSFTPreprocessingConfig")},
    **{name: f"{_SCHEMA}.infra.{name}" for name in (
        "RNGConfig", "DistributedInitConfig", "RerunStateMachineConfig", "ProfilingConfig", "FaultToleranceConfig",
        "InProcessRestartConfig", "StragglerDetectionConfig", "NVRxStragglerDetectionConfig")},
    **{name: f"{_SCHEMA}.optim.{name}" for name in (
        "OptimizerConfig", "DistributedDataParallelConfig", "MixedPrecisionConfig")},
    **{name: f"{_SCHEMA}.training.{name}" for name in (
        "SchedulerConfig", "TrainingConfig", "CheckpointConfig", "LoggerConfig")},
    "GPTModelProvider": "longspan.models.gpt_provider.GPTModelProvider",
    "T5ModelProvider": "longspan.models.t5_provider.T5ModelProvider",
    "MambaProvider": "longspan.models.mamba_provider.MambaProvider",
    "Qwen25VLModelProvider": "longspan.models.vlm.qwen25_vl_provider.Qwen25VLModelProvider",
    "LoRA": "longspan.peft.config.LoRA",
    "DoRA": "longspan.peft.config.DoRA",
    "CanonicalLoRA": "longspan.peft.config.CanonicalLoRA",
}

# Container section -> the classes it may hold (names of CONFIG_CLASSES; the first is built for a mapping
# without ``_target_``). validate() checks the sections against it.
SECTION_TYPES: dict[str, tuple[str, ...]] = {
    "rng": ("RNGConfig",),
    "rerun_state_machine": ("RerunStateMachineConfig",),
    "train": ("TrainingConfig",),
    "model": ("GPTModelProvider", "T5ModelProvider", "MambaProvider", "Qwen25VLModelProvider"),
    "optimizer": ("OptimizerConfig",),
    "ddp": ("DistributedDataParallelConfig",),
    "scheduler": ("SchedulerConfig",),
    "dataset": ("GPTDatasetConfig", "FinetuningDatasetConfig", "DirectHFSFTDatasetConfig"),
    "logger": ("LoggerConfig",),
    "tokenizer": ("TokenizerConfig",),
    "checkpoint": ("CheckpointConfig",),
    "dist": ("DistributedInitConfig",),
    "ft": ("FaultToleranceConfig",),
    "straggler": ("StragglerDetectionConfig",),
    "nvrx_straggler": ("NVRxStragglerDetectionConfig",),
    "profiling": ("ProfilingConfig",),
    "peft": ("LoRA", "DoRA", "CanonicalLoRA"),
    "inprocess_restart": ("InProcessRestartConfig",),
}


@functools.lru_cache(maxsize=None)
def resolve_dotted(path: str) -> Any:
    """The object at ``module.attr`` (an allowlisted longspan name, never a name read from a file)."""
    module, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def config_class(name: str) -> type:
    """The longspan config class called ``name`` (a key of CONFIG_CLASSES)."""
    return resolve_dotted(CONFIG_CLASSES[name])


def section_types() -> dict[str, tuple[type, ...]]:
    """Section name -> the classes it accepts."""
    return {section: tuple(config_class(n) for n in names) for section, names in SECTION_TYPES.items()}


def is_foreign_target(target: str) -> bool:
    """True for Megatron Bridge / Megatron Core names (a run_config.yaml written by Megatron Bridge)."""
    return target.startswith("megatron.")


def resolve_class(target: str, where: str) -> Optional[type]:
    """The longspan config class for ``target``, or None when ``target`` is not a class of the allowlist."""
    for module, names in _LONGSPAN_CLASSES.items():
        if target.startswith(module + ".") and target[len(module) + 1:] in names:
            return config_class(target[len(module) + 1:])
    if target in _FOREIGN_CLASSES:
        return config_class(_FOREIGN_CLASSES[target])
    match = _BRIDGE_PROVIDER.match(target)
    if match:
        name = match.group(1)
        if "T5" in name:
            return config_class("T5ModelProvider")
        if "Mamba" in name or "NemotronH" in name:
            return config_class("MambaProvider")
        if name.startswith("Qwen25VL"):
            return config_class("Qwen25VLModelProvider")
        return config_class("GPTModelProvider")
    return None


def resolve_value_target(target: str, where: str) -> Any:
    """A dtype or callable named by ``_target_`` (with ``_call_: false``); anything else is rejected."""
    if target in DTYPES:
        return DTYPES[target]
    if target in CALLABLES:
        return _callable(target)
    allowed = ", ".join(sorted(set(DTYPES) | set(CALLABLES)))
    raise ConfigError(f"{where}: _target_ {target!r} is not allowed (allowed values: {allowed}; or a longspan config class)")


def _callable(name: str) -> Callable[..., Any]:
    """The allowlisted function ``name`` (a key of CALLABLES)."""
    value = CALLABLES[name]
    return resolve_dotted(value) if isinstance(value, str) else value


def dtype_name(dtype: torch.dtype) -> str:
    """'torch.bfloat16' for torch.bfloat16."""
    names = {torch.float32: "torch.float32", torch.bfloat16: "torch.bfloat16", torch.float16: "torch.float16"}
    if dtype not in names:
        raise ConfigError(f"dtype {dtype} cannot be written to a config: use float32, bfloat16 or float16")
    return names[dtype]


def callable_name(fn: Callable[..., Any], where: str) -> str:
    """The allowlisted name of an activation function."""
    for name in CALLABLES:
        if _callable(name) is fn:
            return name
    raise ConfigError(
        f"{where}={getattr(fn, '__name__', fn)!r} cannot be written to a config: use one of "
        f"{', '.join(sorted(CALLABLES))}"
    )


def parse_dtype(value: Any, where: str) -> torch.dtype:
    """A dtype from 'bf16', 'bfloat16', 'torch.bfloat16' or ``{_target_: torch.bfloat16, _call_: false}``."""
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, dict) and "_target_" in value:
        value = value["_target_"]
    if isinstance(value, str):
        if value in DTYPES:
            return DTYPES[value]
        if value in DTYPE_ALIASES:
            return DTYPE_ALIASES[value]
    raise ConfigError(f"{where}={value!r} is not a dtype: use float32, bfloat16 or float16")


def parse_callable(value: Any, where: str) -> Callable[..., Any]:
    """An activation function from 'silu', 'torch.nn.functional.silu' or a ``_target_`` dict."""
    if callable(value) and not isinstance(value, (str, dict)):
        return value
    if isinstance(value, dict) and "_target_" in value:
        value = value["_target_"]
    if isinstance(value, str):
        name = CALLABLE_ALIASES.get(value, value)
        if name in CALLABLES:
            return _callable(name)
    raise ConfigError(
        f"{where}={value!r} is not an allowed function: use one of {', '.join(sorted(CALLABLE_ALIASES))} "
        "or their torch.nn.functional names"
    )
