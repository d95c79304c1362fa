"""Current Megatron Bridge override files load: the 0.2+ names (dataset.seq_length, logger.mlflow_*,
logger.comet_*, logger.skip_train_metrics_log, checkpoint.async_strategy, ...) with their meaning, written the
way Bridge's tutorials write overrides on top of a recipe."""

from __future__ import annotations

from pathlib import Path

import pytest

from longspan.recipes.loading import load_config
from longspan.config.support import inapplicable_fields
from longspan.core.errors import ConfigError, NotSupportedError

PRETRAIN_OVERRIDES = """\
# Bridge tutorial style: override a recipe's fields by section
model:
  seq_length: 128
  tensor_model_parallel_size: 1
train:
  train_iters: 20
  global_batch_size: 16
  micro_batch_size: 2
dataset:
  seq_length: 128
optimizer:
  lr: 0.0002
  min_lr: 0.00002
scheduler:
  lr_warmup_iters: 2
  lr_warmup_fraction: null
logger:
  log_interval: 1
  skip_train_metrics_log: false
  mlflow_experiment: tutorial
  mlflow_run_name: pretrain-run
  mlflow_tracking_uri: file:///tmp/mlruns
  mlflow_tags:
    owner: tutorial
  comet_project: null
checkpoint:
  save_interval: 10
  async_save: true
  async_strategy: nvrx
"""

FINETUNE_OVERRIDES = """\
model:
  seq_length: 128
dataset:
  seq_length: 128
train:
  train_iters: 10
logger:
  comet_project: tutorial
  comet_experiment_name: lora-run
  comet_tags: [lora, tutorial]
checkpoint:
  save_interval: 5
peft:
  _target_: megatron.bridge.peft.lora.LoRA
  dim: 8
  alpha: 16
"""

QUANTIZATION_OVERRIDES = """\
mixed_precision: bf16_mixed
model:
  seq_length: 128
dataset:
  seq_length: 128
train:
  train_iters: 10
logger:
  skip_train_metrics_log: true
  save_config_filepath: null
"""


def _load(tmp_path: Path, text: str, *overrides: str):
    path = tmp_path / "overrides.yaml"
    path.write_text(text)
    return load_config("tiny", [str(path)], list(overrides))


def test_pretrain_tutorial_overrides(tmp_path: Path) -> None:
    cfg = _load(tmp_path, PRETRAIN_OVERRIDES)
    cfg.validate(world_size=1)
    assert cfg.dataset.sequence_length == 128 == cfg.model.seq_length  # seq_length is the sequence length
    assert cfg.logger.mlflow_experiment == "tutorial" and cfg.logger.mlflow_tags == {"owner": "tutorial"}
    assert cfg.checkpoint.async_strategy == "nvrx"  # accepted; DCP's background executor does the work
    assert "checkpoint.async_strategy" not in " ".join(inapplicable_fields(cfg))  # the default says nothing
    cfg = _load(tmp_path, PRETRAIN_OVERRIDES, "checkpoint.async_strategy=mcore")
    cfg.validate(world_size=1)
    assert "checkpoint.async_strategy='mcore'" in inapplicable_fields(cfg)


def test_dataset_seq_length_alone_sets_the_sequence_length(tmp_path: Path) -> None:
    cfg = load_config("tiny", [], ["model.seq_length=64", "dataset.seq_length=64"])
    cfg.validate(world_size=1)
    assert cfg.dataset.sequence_length == 64
    cfg = load_config("tiny", [], ["dataset.seq_length=64"])  # the model's length must follow, as in Bridge
    with pytest.raises(ConfigError, match="dataset.sequence_length=64 differs from model.seq_length=256"):
        cfg.validate(world_size=1)


def test_finetune_tutorial_overrides_with_peft(tmp_path: Path) -> None:
    cfg = _load(tmp_path, FINETUNE_OVERRIDES)
    assert type(cfg.peft).__name__ == "LoRA" and cfg.peft.dim == 8 and cfg.peft.alpha == 16
    assert cfg.logger.comet_tags == ["lora", "tutorial"] and cfg.dataset.seq_length == 128


def test_quantization_example_overrides(tmp_path: Path) -> None:
    cfg = _load(tmp_path, QUANTIZATION_OVERRIDES)
    cfg.validate(world_size=1)
    assert cfg.model.bf16 and cfg.logger.skip_train_metrics_log


@pytest.mark.parametrize("overrides,fragment", [
    (["logger.mlflow_experiment=exp"], "logger.mlflow_experiment='exp' needs logger.mlflow_run_name"),
    (["logger.comet_project=proj"], "logger.comet_project='proj' needs logger.comet_experiment_name"),
    (["checkpoint.async_strategy=threads"], "checkpoint.async_strategy='threads'"),
])
def test_bridge_fields_are_checked(overrides: list[str], fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config("tiny", [], overrides).validate(world_size=1)
    assert fragment in str(info.value)


@pytest.mark.parametrize("override", [
    "model.test_mode=true", "checkpoint.strict_fsdp_dtensor_load=true",
])
def test_bridge_fields_longspan_does_not_implement_say_so(override: str) -> None:
    with pytest.raises(NotSupportedError, match=override.split("=")[0]):
        load_config("tiny", [], [override]).validate(world_size=1)


def test_save_config_filepath_writes_the_validated_config(tmp_path: Path) -> None:
    from longspan.training.step.forward_step import forward_step
    from longspan.training.pretrain import pretrain
    from tests.training.pretrain_helpers import small_config

    cfg = small_config(tmp_path, "run", train_iters=2, eval_interval=None)
    cfg.checkpoint.save = cfg.checkpoint.load = None
    cfg.logger.save_config_filepath = str(tmp_path / "config.yaml")
    pretrain(cfg, forward_step)
    text = (tmp_path / "config.yaml").read_text()
    assert "save_config_filepath" in text and "train_iters: 2" in text
