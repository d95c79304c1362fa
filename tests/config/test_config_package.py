"""The config package stands on core alone: its ``_target_`` tables name its own classes by dotted path and the
classes above it register themselves, every name resolves to the class it says, and Megatron Bridge's public
module keeps exporting every class."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from longspan.config import targets
from longspan.config.rules.schedule import SCHEDULER_ARGUMENT_RULES
from longspan.config.rules.validate import VALIDATION_RULES

# Megatron Bridge's ``megatron.bridge.training.config`` names and the Megatron Core configs it uses.
BRIDGE_CONFIG_NAMES = [
    "ConfigContainer", "RNGConfig", "DistributedInitConfig", "RerunStateMachineConfig", "DataloaderConfig",
    "GPTDatasetConfig", "MockGPTDatasetConfig", "FinetuningDatasetConfig", "T5MaskedWordPieceDatasetConfig",
    "SchedulerConfig", "TrainingConfig", "CheckpointConfig", "LoggerConfig", "ProfilingConfig",
    "FaultToleranceConfig", "StragglerDetectionConfig", "NVRxStragglerDetectionConfig", "InProcessRestartConfig",
    "OptimizerConfig", "DistributedDataParallelConfig", "TokenizerConfig", "MixedPrecisionConfig",
    "PackedSequenceSpecs", "GPTModelProvider", "T5ModelProvider", "MambaProvider", "TransformerConfig",
    "ModelParallelConfig",
]


def test_importing_config_loads_nothing_above_core() -> None:
    code = (
        "import sys\n"
        "import longspan.config, longspan.config.schema.container, longspan.config.rules.validate\n"
        "import longspan.config.support_doc, longspan.config.targets\n"
        "print(sorted({m.split('.')[1] for m in sys.modules if m.startswith('longspan.')}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['config', 'core']"


@pytest.mark.parametrize("name", sorted(targets.config_class_names()))
def test_every_allowlisted_class_resolves_to_itself(name: str) -> None:
    cls = targets.config_class(name)
    assert cls.__name__ == name and dataclasses.is_dataclass(cls)
    # the _target_ longspan writes for it reads back to the same class
    assert targets.resolve_class(targets.longspan_target(cls), "test") is cls


def test_the_tables_name_only_known_classes() -> None:
    known = set(targets.config_class_names())
    assert {n for section in targets.section_types() for n in targets.section_type_names(section)} <= known
    assert set(targets.foreign_class_names().values()) <= known
    assert targets.section_type_names("model")[0] == "GPTModelProvider"  # a model mapping without _target_
    for name in targets.callables():
        assert callable(targets.parse_callable(name, "test"))
        assert targets.callable_name(targets.parse_callable(name, "test"), "test") in targets.callables()


@pytest.mark.parametrize("name,target", [
    ("GPTModelProvider", "longspan.models.GPTModelProvider"),
    ("Qwen25VLModelProvider", "longspan.models.Qwen25VLModelProvider"),
    ("Gemma3VLModelProvider", "longspan.models.Gemma3VLModelProvider"),
    ("LoRA", "longspan.peft.LoRA"),
    ("CanonicalLoRA", "longspan.peft.CanonicalLoRA"),
    ("TrainingConfig", "longspan.training.config.TrainingConfig"),
])
def test_the_target_longspan_writes_stays_the_same(name: str, target: str) -> None:
    assert targets.longspan_target(targets.config_class(name)) == target


@pytest.mark.parametrize("target,name", [
    ("megatron.bridge.training.config.TrainingConfig", "TrainingConfig"),
    ("megatron.core.optimizer.OptimizerConfig", "OptimizerConfig"),
    ("megatron.bridge.models.llama.llama_provider.Llama3ModelProvider8B", "GPTModelProvider"),
    ("megatron.bridge.models.nemotronh.NemotronHModelProvider", "MambaProvider"),
    ("megatron.bridge.models.gemma_vl.gemma3_vl_provider.Gemma3VLModelProvider", "Gemma3VLModelProvider"),
    ("megatron.bridge.peft.lora.LoRA", "LoRA"),
    ("megatron.bridge.data.datasets.packed_sequence.PackedSequenceSpecs", "PackedSequenceSpecs"),
])
def test_megatron_names_map_onto_longspan_classes(target: str, name: str) -> None:
    assert targets.resolve_class(target, "test") is targets.config_class(name)


@pytest.mark.parametrize("name", BRIDGE_CONFIG_NAMES)
def test_bridge_module_path_exports_every_class(name: str) -> None:
    import longspan.training.config as bridge_path

    assert name in bridge_path.__all__
    cls = getattr(bridge_path, name)
    if name in targets.config_class_names():
        assert cls is targets.config_class(name)


def test_packed_sequence_specs_is_one_class() -> None:
    from longspan.data.sft import PackedSequenceSpecs as from_data
    from longspan.training.config import PackedSequenceSpecs as from_training

    assert from_data is from_training is targets.config_class("PackedSequenceSpecs")


def test_rule_tables_have_unique_names() -> None:
    for table in (VALIDATION_RULES, SCHEDULER_ARGUMENT_RULES):
        names = [name for name, _ in table]
        assert len(names) == len(set(names)) and all(callable(rule) for _, rule in table)
