"""``ConfigContainer``: the whole training run as one object (seeds 000 and 002)."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol, Union

from longspan.config.rules.validate import validate_container
from longspan.config.schema.data import FinetuningDatasetConfig, GPTDatasetConfig, TokenizerConfig
from longspan.config.schema.data_hf import DirectHFSFTDatasetConfig
from longspan.config.schema.infra import (
    DistributedInitConfig,
    FaultToleranceConfig,
    InProcessRestartConfig,
    NVRxStragglerDetectionConfig,
    ProfilingConfig,
    RerunStateMachineConfig,
    RNGConfig,
    StragglerDetectionConfig,
)
from longspan.config.schema.optim import DistributedDataParallelConfig, MixedPrecisionConfig, OptimizerConfig
from longspan.config.schema.training import CheckpointConfig, LoggerConfig, SchedulerConfig, TrainingConfig
from longspan.config.serialize import container_from_dict, dump_yaml, load_yaml_file, to_dict
from longspan.core.errors import ConfigError
from longspan.core.model_parallel_config import ModelParallelConfig


class PEFTConfig(Protocol):
    """What the container asks of its ``peft`` section (``longspan.peft``'s LoRA, DoRA, CanonicalLoRA: classes
    above this package, registered with ``longspan.config.targets``)."""

    def apply(self, model: Any) -> Any:
        """Add the adapters to one model chunk and freeze the rest; returns the chunk."""

    def validate(self) -> None:
        """Check the adapter's fields (one-line errors)."""


@dataclass(kw_only=True)
class ConfigContainer:
    """Every setting of a training run. Construction and edits never validate; ``validate()`` does, lazily.

    After ``validate()`` the container also has ``data_parallel_size``, ``num_microbatches`` and ``world_size``
    (attributes, not fields: they depend on the launch, so they are not written to YAML).
    """

    rng: RNGConfig = field(default_factory=RNGConfig)
    """Random number generation."""

    rerun_state_machine: RerunStateMachineConfig = field(default_factory=RerunStateMachineConfig)
    """Result validation (NaN checks, re-runs)."""

    train: Optional[TrainingConfig] = None
    """Training loop (required)."""

    model: Optional[ModelParallelConfig] = None
    """Model architecture and parallel layout (required)."""

    optimizer: Optional[OptimizerConfig] = None
    """Optimizer (required)."""

    ddp: DistributedDataParallelConfig = field(default_factory=DistributedDataParallelConfig)
    """Data-parallel gradient reduction."""

    scheduler: Optional[SchedulerConfig] = None
    """Learning-rate and weight-decay schedule (required)."""

    dataset: Optional[Union[GPTDatasetConfig, FinetuningDatasetConfig, DirectHFSFTDatasetConfig]] = None
    """Data (required)."""

    logger: Optional[LoggerConfig] = None
    """Logging (required)."""

    tokenizer: Optional[TokenizerConfig] = None
    """Tokenizer (required)."""

    checkpoint: Optional[CheckpointConfig] = None
    """Checkpointing (required)."""

    dist: DistributedInitConfig = field(default_factory=DistributedInitConfig)
    """Distributed initialization."""

    ft: Optional[FaultToleranceConfig] = None
    """NVIDIA fault tolerance (optional)."""

    straggler: Optional[StragglerDetectionConfig] = None
    """Straggler detection (optional)."""

    nvrx_straggler: Optional[NVRxStragglerDetectionConfig] = None
    """NVIDIA Resiliency Extension straggler detection (optional)."""

    profiling: Optional[ProfilingConfig] = None
    """Profiling (optional)."""

    peft: Optional[PEFTConfig] = None
    """Parameter-efficient finetuning: LoRA, DoRA or CanonicalLoRA (longspan.peft). The base model is frozen and
    loaded from checkpoint.pretrained_checkpoint; only the adapters train and are checkpointed."""

    inprocess_restart: Optional[InProcessRestartConfig] = None
    """In-process restart (optional): a failed rank is replaced without restarting the other ranks' processes."""

    comm_overlap: Optional[dict[str, Any]] = None
    """Megatron Bridge's CommOverlapConfig fields: overlap settings derived from the layout, with these values
    on top, copied onto model, ddp and optimizer by validate() (longspan.config.rules.comm_overlap)."""

    mixed_precision: Optional[Union[MixedPrecisionConfig, str]] = None
    """Precision recipe name ('bf16_mixed', 'fp16_mixed', 'fp32') or a MixedPrecisionConfig; validate() copies
    it onto model, optimizer and ddp. None: model and optimizer precision flags must agree."""

    def __post_init__(self) -> None:
        # Derived by validate(); None until then.
        self.data_parallel_size: Optional[int] = None
        self.num_microbatches: Optional[int] = None
        self.world_size: Optional[int] = None

    def get_data_parallel_size(self, world_size: int) -> int:
        """world_size / (tensor x pipeline x context parallel sizes)."""
        m = self.model
        model_parallel = m.tensor_model_parallel_size * m.pipeline_model_parallel_size * m.context_parallel_size
        if world_size % model_parallel != 0:
            raise ConfigError(
                f"world size {world_size} is not divisible by tensor x pipeline x context parallel size "
                f"({model_parallel})"
            )
        return world_size // model_parallel

    def validate(self, world_size: Optional[int] = None) -> None:
        """Resolve defaults, derive sizes and schedule lengths, and check consistency (raises ConfigError).

        ``world_size`` defaults to torch.distributed's when initialized, else env WORLD_SIZE, else 1. Safe to
        call more than once.
        """
        validate_container(self, world_size)

    # ---- serialization -----------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain-data form with ``_target_`` keys (what to_yaml writes)."""
        return to_dict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], allow_unknown: bool = False) -> "ConfigContainer":
        """Build a container from ``to_dict`` output, a longspan YAML, or a Megatron Bridge run_config."""
        return container_from_dict(data, allow_unknown=allow_unknown)

    def to_yaml(self, path: Optional[str] = None) -> str:
        """The YAML text; also written to ``path`` when given."""
        text = dump_yaml(self)
        if path is not None:
            with open(path, "w", encoding="utf-8") as fh:
                fh.write(text)
        return text

    @classmethod
    def from_yaml(cls, path: str, allow_unknown: bool = False) -> "ConfigContainer":
        """Load a container saved by ``to_yaml`` (or a Megatron Bridge run_config.yaml)."""
        return container_from_dict(load_yaml_file(path), allow_unknown=allow_unknown, source=path)

    def print_yaml(self) -> None:
        """Write the YAML to stdout."""
        sys.stdout.write(self.to_yaml())

