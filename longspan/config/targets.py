"""The ``_target_`` allowlist: the only names a config file may refer to.

Nothing named in a file is ever imported or called. A ``_target_`` is looked up in these tables; longspan
config classes are constructed with the file's values, known dtypes and activation functions are returned as
objects, and everything else is an error. Megatron Bridge and Megatron Core names map onto longspan's.

The config classes of this package are named by dotted path, resolved with importlib on first use. The model
providers, the PEFT configs and the activation functions live in packages above ``config``, which this package
never imports: they register themselves here (``register_config_class``, ``register_callable``), and every
lookup first loads the registering packages (``longspan.core.plugins.load_plugins``).
"""

from __future__ import annotations

import functools
import importlib
import re
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from longspan.core.errors import ConfigError
from longspan.core.plugins import load_plugins

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

# Allowlisted functions: the name a config file writes -> the object (longspan's own register themselves).
CALLABLES: dict[str, Any] = {
    "torch.nn.functional.gelu": F.gelu,
    "torch.nn.functional.silu": F.silu,
    "torch.nn.functional.relu": F.relu,
    "torch.nn.functional.tanh": torch.tanh,
    "torch.tanh": torch.tanh,
    "torch.sigmoid": torch.sigmoid,
    "torch.nn.functional.sigmoid": torch.sigmoid,
}
CALLABLE_ALIASES: dict[str, str] = {
    "gelu": "torch.nn.functional.gelu", "silu": "torch.nn.functional.silu", "swish": "torch.nn.functional.silu",
    "relu": "torch.nn.functional.relu", "tanh": "torch.tanh", "sigmoid": "torch.sigmoid",
    "F.gelu": "torch.nn.functional.gelu", "F.silu": "torch.nn.functional.silu", "F.relu": "torch.nn.functional.relu",
}


def register_callable(fn: Callable[..., Any], aliases: tuple[str, ...] = ()) -> str:
    """Allowlist ``fn`` under its module path (the name a config file writes) and ``aliases``; returns the name."""
    name = f"{fn.__module__}.{fn.__name__}"
    CALLABLES[name] = fn
    for alias in aliases:
        CALLABLE_ALIASES[alias] = name
    return name


def callables() -> dict[str, Any]:
    """Every allowlisted function: name -> object."""
    load_plugins()
    return CALLABLES


# The module of the ``_target_`` longspan writes for the config classes of this package (Bridge's path).
TRAINING_CONFIG_MODULE = "longspan.training.config"
# The config classes of this package (they are in Bridge's ``training.config``).
_CONFIG_NAMES = [
    "ConfigContainer", "RNGConfig", "DistributedInitConfig", "RerunStateMachineConfig", "DataloaderConfig",
    "GPTDatasetConfig", "MockGPTDatasetConfig", "FinetuningDatasetConfig", "SchedulerConfig",
    "T5MaskedWordPieceDatasetConfig",
    "TrainingConfig", "CheckpointConfig", "LoggerConfig", "ProfilingConfig", "FaultToleranceConfig",
    "StragglerDetectionConfig", "NVRxStragglerDetectionConfig", "InProcessRestartConfig", "OptimizerConfig",
    "DistributedDataParallelConfig", "TokenizerConfig", "MixedPrecisionConfig", "PackedSequenceSpecs",
    "DirectHFSFTDatasetConfig", "HFDatasetSourceConfig", "ChatSFTPreprocessingConfig",
]

# Megatron Bridge / Megatron Core names -> longspan class name (the registered classes add theirs).
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
}
for _name in _CONFIG_NAMES:
    _FOREIGN_CLASSES.setdefault(f"megatron.bridge.training.config.{_name}", _name)
    _FOREIGN_CLASSES.setdefault(f"megatron.training.config.{_name}", _name)

# Model providers of particular Bridge model families (Llama3ModelProvider8B, Qwen3ModelProvider, ...) load as the
# registered class whose name pattern matches (``register_config_class(bridge_provider_pattern=...)``), else as
# the model section's first class (GPT: their run_config lists every field).
_BRIDGE_PROVIDER = re.compile(r"^megatron\.bridge\.models\.[A-Za-z0-9_.]*\.([A-Za-z0-9_]*Provider[A-Za-z0-9_]*)$")

_SCHEMA = "longspan.config.schema"

# Where every config class of this package is defined (dotted paths, imported on first use).
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
}

# Container section -> the classes it may hold (the first is built for a mapping without ``_target_``); the
# ``model`` and ``peft`` sections are filled by the registered classes, in registration order. validate()
# checks the sections against it.
SECTION_TYPES: dict[str, tuple[str, ...]] = {
    "rng": ("RNGConfig",),
    "rerun_state_machine": ("RerunStateMachineConfig",),
    "train": ("TrainingConfig",),
    "model": (),
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
    "peft": (),
    "inprocess_restart": ("InProcessRestartConfig",),
}

# The registered classes (defined above this package): name -> class, and the module of their ``_target_``.
_REGISTERED: dict[str, type] = {}
_TARGET_MODULE: dict[str, str] = {name: TRAINING_CONFIG_MODULE for name in _CONFIG_NAMES}
_BRIDGE_PROVIDER_PATTERNS: list[tuple[re.Pattern[str], str]] = []


def register_config_class(cls: type, section: str, canonical_module: str, foreign_names: tuple[str, ...] = (),
                          bridge_provider_pattern: Optional[str] = None) -> None:
    """Allowlist config class ``cls`` (a model provider, a PEFT config) for container section ``section``.

    ``canonical_module``: the module of the ``_target_`` longspan writes for it (``<module>.<class name>``);
    ``foreign_names``: Megatron Bridge's dotted names of the same class; ``bridge_provider_pattern``: a regular
    expression searched in the class name of other Bridge providers that load as ``cls`` (checked in
    registration order)."""
    name = cls.__name__
    if name in _REGISTERED or name in CONFIG_CLASSES:
        raise ValueError(f"config class {name!r} is registered twice")
    _REGISTERED[name] = cls
    _TARGET_MODULE[name] = canonical_module
    SECTION_TYPES[section] = SECTION_TYPES[section] + (name,)
    for foreign in foreign_names:
        _FOREIGN_CLASSES[foreign] = name
    if bridge_provider_pattern is not None:
        _BRIDGE_PROVIDER_PATTERNS.append((re.compile(bridge_provider_pattern), name))


def registered_class(name: str, canonical_module: str) -> Optional[type]:
    """The registered config class ``name`` whose ``_target_`` module is ``canonical_module``, or None (for the
    packages whose public names these classes are: ``longspan.models`` and its attribute of the class's name)."""
    load_plugins()
    if _TARGET_MODULE.get(name) == canonical_module and name in _REGISTERED:
        return _REGISTERED[name]
    return None


def config_class_names() -> list[str]:
    """Every config class a file may name: this package's and the registered ones."""
    load_plugins()
    return [*CONFIG_CLASSES, *_REGISTERED]


def foreign_class_names() -> dict[str, str]:
    """Megatron Bridge / Megatron Core dotted name -> longspan class name."""
    load_plugins()
    return dict(_FOREIGN_CLASSES)


def section_type_names(section: str) -> tuple[str, ...]:
    """The class names container section ``section`` accepts (empty for no section of that name)."""
    load_plugins()
    return SECTION_TYPES.get(section, ())


def longspan_target(cls: type) -> str:
    """The ``_target_`` longspan writes for one of its config classes."""
    load_plugins()
    module = _TARGET_MODULE.get(cls.__name__)
    if module is None:
        raise ConfigError(f"{cls.__name__} is not a longspan config class")
    return f"{module}.{cls.__name__}"


@functools.lru_cache(maxsize=None)
def resolve_dotted(path: str) -> Any:
    """The object at ``module.attr`` (an allowlisted longspan name, never a name read from a file)."""
    module, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def config_class(name: str) -> type:
    """The longspan config class called ``name`` (a name of ``config_class_names()``)."""
    if name in CONFIG_CLASSES:
        return resolve_dotted(CONFIG_CLASSES[name])
    load_plugins()
    return _REGISTERED[name]


def section_types() -> dict[str, tuple[type, ...]]:
    """Section name -> the classes it accepts."""
    load_plugins()
    return {section: tuple(config_class(n) for n in names) for section, names in SECTION_TYPES.items()}


def is_foreign_target(target: str) -> bool:
    """True for Megatron Bridge / Megatron Core names (a run_config.yaml written by Megatron Bridge)."""
    return target.startswith("megatron.")


def resolve_class(target: str, where: str) -> Optional[type]:
    """The longspan config class for ``target``, or None when ``target`` is not a class of the allowlist."""
    load_plugins()
    module, _, name = target.rpartition(".")
    if module and _TARGET_MODULE.get(name) == module:
        return config_class(name)
    if target in _FOREIGN_CLASSES:
        return config_class(_FOREIGN_CLASSES[target])
    match = _BRIDGE_PROVIDER.match(target)
    if match:
        for pattern, registered in _BRIDGE_PROVIDER_PATTERNS:
            if pattern.search(match.group(1)):
                return config_class(registered)
        return config_class(SECTION_TYPES["model"][0])
    return None


def resolve_value_target(target: str, where: str) -> Any:
    """A dtype or callable named by ``_target_`` (with ``_call_: false``); anything else is rejected."""
    if target in DTYPES:
        return DTYPES[target]
    load_plugins()
    if target in CALLABLES:
        return _callable(target)
    allowed = ", ".join(sorted(set(DTYPES) | set(CALLABLES)))
    raise ConfigError(f"{where}: _target_ {target!r} is not allowed (allowed values: {allowed}; or a longspan config class)")


def _callable(name: str) -> Callable[..., Any]:
    """The allowlisted function ``name`` (a key of CALLABLES)."""
    return CALLABLES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """'torch.bfloat16' for torch.bfloat16."""
    names = {torch.float32: "torch.float32", torch.bfloat16: "torch.bfloat16", torch.float16: "torch.float16"}
    if dtype not in names:
        raise ConfigError(f"dtype {dtype} cannot be written to a config: use float32, bfloat16 or float16")
    return names[dtype]


def callable_name(fn: Callable[..., Any], where: str) -> str:
    """The allowlisted name of an activation function."""
    load_plugins()
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
    load_plugins()
    if isinstance(value, str):
        name = CALLABLE_ALIASES.get(value, value)
        if name in CALLABLES:
            return _callable(name)
    raise ConfigError(
        f"{where}={value!r} is not an allowed function: use one of {', '.join(sorted(CALLABLE_ALIASES))} "
        "or their torch.nn.functional names"
    )
