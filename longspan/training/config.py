"""Every configuration class of a training run (Megatron Bridge's ``megatron.bridge.training.config``, plus
the Megatron Core configs it borrows).

Dataclasses only: construction never validates. ``ConfigContainer.validate()`` resolves defaults, derives
the data-parallel size, the number of microbatches and the scheduler lengths, and checks consistency.
The config classes live in ``longspan.config.schema.*`` and the model providers in ``longspan.models``; this
module is their public name (the ``_target_`` longspan writes in YAML).
"""

from longspan.config.schema.container import ConfigContainer
from longspan.config.schema.data import (
    DataloaderConfig,
    FinetuningDatasetConfig,
    GPTDatasetConfig,
    MockGPTDatasetConfig,
    PackedSequenceSpecs,
    T5MaskedWordPieceDatasetConfig,
    TokenizerConfig,
)
from longspan.config.schema.data_hf import (
    ChatSFTPreprocessingConfig,
    DirectHFSFTDatasetConfig,
    HFDatasetSourceConfig,
)
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
from longspan.config.schema.optim import (
    MIXED_PRECISION_RECIPES,
    DistributedDataParallelConfig,
    MixedPrecisionConfig,
    OptimizerConfig,
    bf16_mixed,
    fp16_mixed,
    fp32,
    get_mixed_precision_config,
)
from longspan.config.schema.training import CheckpointConfig, LoggerConfig, SchedulerConfig, TrainingConfig
from longspan.core.model_parallel_config import ModelParallelConfig
from longspan.models.gpt_provider import GPTModelProvider, TransformerConfig
from longspan.models.mamba_provider import MambaProvider
from longspan.models.t5_provider import T5ModelProvider

__all__ = [
    "RNGConfig", "DistributedInitConfig", "RerunStateMachineConfig", "DataloaderConfig", "GPTDatasetConfig",
    "MockGPTDatasetConfig", "T5MaskedWordPieceDatasetConfig", "FinetuningDatasetConfig", "SchedulerConfig",
    "TrainingConfig", "CheckpointConfig",
    "LoggerConfig", "ProfilingConfig", "FaultToleranceConfig", "StragglerDetectionConfig",
    "NVRxStragglerDetectionConfig", "InProcessRestartConfig", "ConfigContainer", "OptimizerConfig",
    "DistributedDataParallelConfig",
    "TokenizerConfig", "MixedPrecisionConfig", "MIXED_PRECISION_RECIPES", "bf16_mixed", "fp16_mixed", "fp32",
    "get_mixed_precision_config", "ModelParallelConfig", "TransformerConfig", "GPTModelProvider",
    "T5ModelProvider", "MambaProvider", "PackedSequenceSpecs",
    "DirectHFSFTDatasetConfig", "HFDatasetSourceConfig", "ChatSFTPreprocessingConfig",
]
