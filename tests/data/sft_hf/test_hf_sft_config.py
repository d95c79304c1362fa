"""DirectHFSFTDatasetConfig from YAML with Megatron Bridge's ``_target_`` paths (nested sources too), dotlists,
the YAML round trip, and the one-line errors of its rules."""

from __future__ import annotations

import pytest
import yaml

from longspan.config.overrides import apply_overrides
from longspan.config.schema.data_hf import ChatSFTPreprocessingConfig, DirectHFSFTDatasetConfig, HFDatasetSourceConfig
from longspan.core.errors import ConfigError, NotSupportedError
from tests.training.pretrain_helpers import small_config

BRIDGE_DATASET = """
_target_: megatron.bridge.data.builders.direct_hf_sft.DirectHFSFTDatasetConfig
seq_length: 64
source:
  - _target_: megatron.bridge.data.sources.hf.HFDatasetSourceConfig
    path_or_dataset: /data/chat.jsonl
    split: train
  - _target_: megatron.bridge.data.builders.HFDatasetSourceConfig
    path_or_dataset: json
    load_kwargs: {data_files: /data/alpaca.jsonl}
    schema_adapter: alpaca
    adapter_kwargs: {output_column: response}
source_weights: [1, 3]
blend_seed: 7
validation_source:
  _target_: megatron.bridge.data.sources.hf.HFDatasetSourceConfig
  path_or_dataset: /data/valid.parquet
preprocessing:
  _target_: megatron.bridge.data.sft_processing.ChatSFTPreprocessingConfig
  loss_mode: last_turn
do_test: false
num_workers: 0
"""


def _container(tmp_path, dataset_yaml: str = BRIDGE_DATASET):
    from longspan.training.config import ConfigContainer

    data = small_config(tmp_path).to_dict()
    data["dataset"] = yaml.safe_load(dataset_yaml)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return ConfigContainer.from_yaml(str(path))


def test_bridge_targets_load_nested_sources(tmp_path):
    cfg = _container(tmp_path)
    d = cfg.dataset
    assert isinstance(d, DirectHFSFTDatasetConfig)
    assert [type(s) for s in d.source] == [HFDatasetSourceConfig, HFDatasetSourceConfig]
    assert d.source[1].load_kwargs == {"data_files": "/data/alpaca.jsonl"} and d.source[1].schema_adapter == "alpaca"
    assert d.source_weights == [1, 3] and d.blend_seed == 7 and d.do_test is False
    assert d.validation_source.path_or_dataset == "/data/valid.parquet"
    assert d.preprocessing == ChatSFTPreprocessingConfig(loss_mode="last_turn")
    assert d.dataloader_type == "cyclic" and d.pad_to_multiple_of == 128  # Bridge's defaults
    cfg.validate(world_size=1)
    # longspan writes its own names and reads them back to the same config
    again = type(cfg).from_dict(yaml.safe_load(cfg.to_yaml()))
    assert again.dataset == d
    assert "longspan.training.config.HFDatasetSourceConfig" in cfg.to_yaml()


def test_mappings_without_targets_and_dotlists(tmp_path):
    cfg = _container(tmp_path, """
_target_: longspan.training.config.DirectHFSFTDatasetConfig
seq_length: 64
source: {path_or_dataset: /data/chat.jsonl}
""")
    assert cfg.dataset.source == HFDatasetSourceConfig(path_or_dataset="/data/chat.jsonl")
    apply_overrides(cfg, ["dataset.preprocessing={loss_mode: full}",
                          "dataset.source=[{path_or_dataset: a.jsonl}, {path_or_dataset: b.parquet}]",
                          "dataset.source_weights=[0.3,0.7]", "dataset.do_validation=false"])
    assert cfg.dataset.preprocessing.loss_mode == "full"
    assert [s.path_or_dataset for s in cfg.dataset.source] == ["a.jsonl", "b.parquet"]
    cfg.validate(world_size=1)


@pytest.mark.parametrize("change,error,pattern", [
    ({"source": {"dataset_name": "squad"}, "source_weights": None}, NotSupportedError,
     r"^dataset.source.dataset_name='squad': Megatron Bridge's named dataset presets are not supported yet"),
    ({"source_weights": [1.0]}, ConfigError, r"^dataset.source_weights has 1 weight\(s\) for 2 source\(s\)"),
    ({"source_weights": [1.0, -2.0]}, ConfigError, r"weights must be positive"),
    ({"validation_source": None}, ConfigError, r"blends several sources.*set dataset.validation_source or "
                                               r"dataset.do_validation=False"),
    ({"source": [{"path_or_dataset": "a.jsonl", "schema_adapter": "openai"}, {"path_or_dataset": "b.jsonl"}]},
     ConfigError, r"^dataset.source\[0\].schema_adapter='openai' is not known: use one of messages, conversation"),
    ({"source": [{"path_or_dataset": "a", "load_kwargs": {"split": "x"}}, {"path_or_dataset": "b"}]}, ConfigError,
     r"dataset.source\[0\].load_kwargs sets \['split'\]"),
    ({"seq_length": 32}, ConfigError, r"^dataset.seq_length=32 differs from model.seq_length=64"),
    ({"defer_in_batch_packing_to_step": True}, ConfigError,
     r"^dataset.defer_in_batch_packing_to_step=True is set without dataset.enable_in_batch_packing=True"),
    ({"in_batch_packing_pad_to_multiple_of": 8}, ConfigError,
     r"^dataset.in_batch_packing_pad_to_multiple_of=8 is set without dataset.enable_in_batch_packing=True"),
    ({"enable_in_batch_packing": True, "in_batch_packing_pad_to_multiple_of": 0}, ConfigError,
     r"^dataset.in_batch_packing_pad_to_multiple_of=0 must be an integer >= 1"),
    ({"enable_in_batch_packing": True, "pad_to_max_length": True}, ConfigError,
     r"^dataset.pad_to_max_length=True with dataset.enable_in_batch_packing=True: a packed microbatch"),
    ({"enable_in_batch_packing": True, "defer_in_batch_packing_to_step": True, "hf_processor_path": "/models/vl"},
     NotSupportedError, r"^dataset.defer_in_batch_packing_to_step=True with dataset.hf_processor_path is not supported"),
    ({"hf_processor_kwargs": {"min_pixels": 784}}, ConfigError,
     r"^dataset.hf_processor_kwargs=\{'min_pixels': 784\} is set without dataset.hf_processor_path"),
    ({"preprocessing": {"loss_mode": "answers"}}, ConfigError, r"loss_mode='answers' is not valid"),
])
def test_rules_stop_in_one_line(tmp_path, change, error, pattern):
    data = yaml.safe_load(BRIDGE_DATASET)
    data.update(change)
    with pytest.raises(error, match=pattern) as info:
        _container(tmp_path, yaml.safe_dump(data)).validate(world_size=1)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("setting,error,pattern", [
    ("train.micro_batch_size=1", ConfigError, r"^dataset.enable_in_batch_packing=True with train.micro_batch_size=1: "),
    ("model.pipeline_model_parallel_size=2", NotSupportedError,
     r"^dataset.enable_in_batch_packing=True with model.pipeline_model_parallel_size=2: pipeline stages exchange"),
    ("model.context_parallel_size=2", NotSupportedError,
     r"^dataset.enable_in_batch_packing=True with model.context_parallel_size=2: "),
    ("model.tensor_model_parallel_size=2 model.sequence_parallel=true dataset.in_batch_packing_pad_to_multiple_of=3",
     ConfigError, r"^dataset.in_batch_packing_pad_to_multiple_of=3 must be a multiple of tensor_model_parallel_size=2"),
])
def test_in_batch_packing_layout_rules(tmp_path, setting, error, pattern):
    cfg = _container(tmp_path)
    apply_overrides(cfg, ["dataset.enable_in_batch_packing=true", *setting.split()])
    with pytest.raises(error, match=pattern) as info:
        cfg.validate(world_size=2)
    assert "\n" not in str(info.value)
    cfg = _container(tmp_path)
    apply_overrides(cfg, ["dataset.enable_in_batch_packing=true", "dataset.defer_in_batch_packing_to_step=true",
                          "dataset.in_batch_packing_pad_to_multiple_of=4"])
    cfg.validate(world_size=1)


def test_support_doc_is_current():
    from longspan.config.support_doc import main

    assert main(["--check"]) == 0
