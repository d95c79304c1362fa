"""The ``_target_`` allowlist: the only names a config file may refer to.

Nothing named in a file is ever imported or called. A ``_target_`` is looked up in these tables; longspan
config classes are constructed with the file's values, known dtypes and activation functions are returned as
objects, and everything else is an error. Megatron Bridge and Megatron Core names map onto longspan's.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from longspan.core.errors import ConfigError
from longspan.models.activations import gelu_tanh, squared_relu

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

CALLABLES: dict[str, Callable[..., Any]] = {
    "torch.nn.functional.gelu": F.gelu,
    "torch.nn.functional.silu": F.silu,
    "torch.nn.functional.relu": F.relu,
    "torch.nn.functional.tanh": torch.tanh,
    "torch.tanh": torch.tanh,
    "torch.sigmoid": torch.sigmoid,
    "torch.nn.functional.sigmoid": torch.sigmoid,
    "longspan.models.activations.gelu_tanh": gelu_tanh,
    "longspan.models.activations.squared_relu": squared_relu,
}
CALLABLE_ALIASES: dict[str, str] = {
    "gelu": "torch.nn.functional.gelu", "silu": "torch.nn.functional.silu", "swish": "torch.nn.functional.silu",
    "relu": "torch.nn.functional.relu", "tanh": "torch.tanh", "sigmoid": "torch.sigmoid",
    "F.gelu": "torch.nn.functional.gelu", "F.silu": "torch.nn.functional.silu", "F.relu": "torch.nn.functional.relu",
    "gelu_tanh": "longspan.models.activations.gelu_tanh", "openai_gelu": "longspan.models.activations.gelu_tanh",
    "squared_relu": "longspan.models.activations.squared_relu",
    "megatron.core.activations.squared_relu": "longspan.models.activations.squared_relu",
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
    ],
    "longspan.models": ["GPTModelProvider", "T5ModelProvider", "MambaProvider"],
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
    "megatron.core.datasets.t5_dataset.T5MaskedWordPieceDatasetConfig": "T5MaskedWordPieceDatasetConfig",
    "megatron.bridge.models.gpt_provider.GPTModelProvider": "GPTModelProvider",
    "megatron.bridge.models.GPTModelProvider": "GPTModelProvider",
    "megatron.bridge.models.T5ModelProvider": "T5ModelProvider",
    "megatron.bridge.models.t5_provider.T5ModelProvider": "T5ModelProvider",
    "megatron.bridge.models.mamba.mamba_provider.MambaProvider": "MambaProvider",
    "megatron.bridge.models.MambaProvider": "MambaProvider",
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


# The config classes, registered by the module that defines the container (longspan.config.schema.container
# registers every section class when it is imported): this layer looks them up and imports nothing above it.
_REGISTERED: dict[str, type] = {}
_SECTION_TYPES: dict[str, tuple[type, ...]] = {}


def register_config_classes(classes: Any, section_types: Optional[dict[str, tuple[type, ...]]] = None) -> None:
    """Make ``classes`` known to the loader by name; ``section_types`` maps container sections to classes."""
    for cls in classes:
        _REGISTERED[cls.__name__] = cls
    if section_types:
        _SECTION_TYPES.update(section_types)
        for types_ in section_types.values():
            for cls in types_:
                _REGISTERED[cls.__name__] = cls


def registered_section_types() -> dict[str, tuple[type, ...]]:
    """Section name -> accepted classes, as registered by the container module."""
    return dict(_SECTION_TYPES)


def _class_by_name(name: str) -> type:
    cls = _REGISTERED.get(name)
    if cls is None:
        raise ConfigError(
            f"config class {name} is not registered: import longspan.training.config (it registers the classes)"
        )
    return cls


def is_foreign_target(target: str) -> bool:
    """True for Megatron Bridge / Megatron Core names (a run_config.yaml written by Megatron Bridge)."""
    return target.startswith("megatron.")


def resolve_class(target: str, where: str) -> Optional[type]:
    """The longspan config class for ``target``, or None when ``target`` is not a class of the allowlist."""
    for module, names in _LONGSPAN_CLASSES.items():
        if target.startswith(module + ".") and target[len(module) + 1:] in names:
            return _class_by_name(target[len(module) + 1:])
    if target in _FOREIGN_CLASSES:
        return _class_by_name(_FOREIGN_CLASSES[target])
    match = _BRIDGE_PROVIDER.match(target)
    if match:
        name = match.group(1)
        if "T5" in name:
            return _class_by_name("T5ModelProvider")
        if "Mamba" in name or "NemotronH" in name:
            return _class_by_name("MambaProvider")
        return _class_by_name("GPTModelProvider")
    return None


def resolve_value_target(target: str, where: str) -> Any:
    """A dtype or callable named by ``_target_`` (with ``_call_: false``); anything else is rejected."""
    if target in DTYPES:
        return DTYPES[target]
    if target in CALLABLES:
        return CALLABLES[target]
    allowed = ", ".join(sorted(set(DTYPES) | set(CALLABLES)))
    raise ConfigError(f"{where}: _target_ {target!r} is not allowed (allowed values: {allowed}; or a longspan config class)")


def dtype_name(dtype: torch.dtype) -> str:
    """'torch.bfloat16' for torch.bfloat16."""
    names = {torch.float32: "torch.float32", torch.bfloat16: "torch.bfloat16", torch.float16: "torch.float16"}
    if dtype not in names:
        raise ConfigError(f"dtype {dtype} cannot be written to a config: use float32, bfloat16 or float16")
    return names[dtype]


def callable_name(fn: Callable[..., Any], where: str) -> str:
    """The allowlisted name of an activation function."""
    for name, value in CALLABLES.items():
        if value is fn:
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
            return CALLABLES[name]
    raise ConfigError(
        f"{where}={value!r} is not an allowed function: use one of {', '.join(sorted(CALLABLE_ALIASES))} "
        "or their torch.nn.functional names"
    )
