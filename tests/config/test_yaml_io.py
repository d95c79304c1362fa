"""YAML round trips, override files in Megatron Bridge's shape, dotlists, and safe loading."""

from __future__ import annotations

import math
import signal
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml

from longspan.cli import main
from longspan.recipes.loading import load_config
from longspan.core.errors import ConfigError
from longspan.recipes import get_recipe, list_recipes
from longspan.training.config import ConfigContainer, MockGPTDatasetConfig


@pytest.mark.parametrize("name", sorted(list_recipes()))
@pytest.mark.parametrize("validated", [False, True])
def test_every_recipe_round_trips(tmp_path: Path, name: str, validated: bool) -> None:
    cfg = get_recipe(name)
    if validated:  # on 8 ranks, or the fewest a real-size recipe's layout needs (a multiple of 8)
        m = cfg.model
        dense = m.tensor_model_parallel_size * m.pipeline_model_parallel_size * m.context_parallel_size
        # Unset expert tensor parallel follows tensor parallel (Megatron's default, and validate()'s)
        etp = m.expert_tensor_parallel_size or m.tensor_model_parallel_size
        experts = etp * m.expert_model_parallel_size * m.pipeline_model_parallel_size
        cfg.validate(world_size=math.lcm(8, dense, experts))
    path = tmp_path / "cfg.yaml"
    text = cfg.to_yaml(str(path))
    assert path.read_text() == text
    loaded = ConfigContainer.from_yaml(str(path))
    assert loaded == cfg
    assert loaded.to_yaml() == text
    # Types survive: dtypes and activation functions come back as the objects, not strings.
    assert loaded.model.activation_func is cfg.model.activation_func
    assert loaded.optimizer.params_dtype is cfg.optimizer.params_dtype
    assert isinstance(loaded.model.params_dtype, (torch.dtype, type(None)))


def test_dtype_callable_and_signal_are_written_as_targets() -> None:
    cfg = get_recipe("tiny")
    cfg.validate(world_size=1)
    data = yaml.safe_load(cfg.to_yaml())
    assert data["model"]["activation_func"] == {"_target_": "torch.nn.functional.silu", "_call_": False}
    assert data["model"]["params_dtype"] == {"_target_": "torch.float32", "_call_": False}
    assert data["train"]["exit_signal"] == int(signal.SIGTERM)
    assert "lr_warmup_steps" not in data["scheduler"]  # derived, recomputed by validate()
    assert data["dataset"]["data_path"] == "builtin:stdlib"
    assert data["tokenizer"]["tokenizer_model"] == "builtin:stdlib"


def test_config_show_round_trip_is_byte_identical(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["config", "show", "--recipe", "tiny"]) == 0
    first = capsys.readouterr().out
    path = tmp_path / "tiny.yaml"
    path.write_text(first)
    assert main(["config", "show", "--config", str(path)]) == 0
    assert capsys.readouterr().out == first


BRIDGE_OVERRIDE = """
train:
  train_iters: 77
  global_batch_size: 32
optimizer:
  lr: 1.0e-4
  weight_decay: 0.05
scheduler:
  lr_decay_style: linear
checkpoint:
  save: /tmp/elsewhere
logger:
  log_interval: 3
model:
  num_layers: 8
  activation_func:
    _target_: torch.nn.functional.gelu
    _call_: false
rng:
  seed: 7
"""


def test_bridge_shaped_override_file_changes_only_named_fields(tmp_path: Path) -> None:
    override = tmp_path / "override.yaml"
    override.write_text(BRIDGE_OVERRIDE)
    base = get_recipe("tiny")
    cfg = load_config("tiny", [str(override)], [])
    assert (cfg.train.train_iters, cfg.train.global_batch_size) == (77, 32)
    assert cfg.optimizer.lr == 1e-4 and cfg.optimizer.weight_decay == 0.05
    assert cfg.scheduler.lr_decay_style == "linear"
    assert cfg.checkpoint.save == "/tmp/elsewhere" and cfg.checkpoint.load == base.checkpoint.load
    assert cfg.logger.log_interval == 3 and cfg.rng.seed == 7
    assert cfg.model.num_layers == 8 and cfg.model.activation_func is F.gelu
    # Everything not named keeps the recipe's value.
    assert cfg.model.hidden_size == base.model.hidden_size
    assert cfg.train.micro_batch_size == base.train.micro_batch_size
    assert cfg.optimizer.min_lr == base.optimizer.min_lr
    assert cfg.dataset == base.dataset


def test_order_recipe_then_files_then_dotlist(tmp_path: Path) -> None:
    first, second = tmp_path / "a.yaml", tmp_path / "b.yaml"
    first.write_text("train:\n  train_iters: 10\n  eval_iters: 2\n")
    second.write_text("train:\n  train_iters: 20\n")
    cfg = load_config("tiny", [str(first), str(second)], ["train.train_iters=30"])
    assert cfg.train.train_iters == 30  # dotlist wins
    assert cfg.train.eval_iters == 2  # from the first file, untouched by the second
    cfg = load_config("tiny", [str(first), str(second)], [])
    assert cfg.train.train_iters == 20  # later file wins


def test_dotlist_values_are_yaml_scalars() -> None:
    cfg = load_config("tiny", [], [
        "dataset.data_path=null", "train.rampup_batch_size=[4, 4, 100]", "optimizer.lr=3e-4",
        "model.bf16=true", "optimizer.bf16=true", "model.params_dtype=bf16", "mixed_precision=bf16_mixed",
        "model.activation_func=gelu", "logger.tensorboard_dir=/tmp/tb", "model.num_layers=8",
    ])
    assert cfg.dataset.data_path is None
    assert cfg.train.rampup_batch_size == [4, 4, 100]
    assert cfg.optimizer.lr == pytest.approx(3e-4) and isinstance(cfg.optimizer.lr, float)
    assert cfg.model.bf16 is True and cfg.model.params_dtype is torch.bfloat16
    assert cfg.mixed_precision == "bf16_mixed"
    assert cfg.model.activation_func is F.gelu
    assert cfg.model.num_layers == 8


def test_dotlist_creates_optional_section_and_switches_dataset_class(tmp_path: Path) -> None:
    cfg = load_config("tiny", [], ["profiling.use_pytorch_profiler=true", "ft.enable_ft_package=false"])
    assert cfg.profiling.use_pytorch_profiler is True and cfg.ft is not None
    other = tmp_path / "mock.yaml"
    other.write_text(textwrap.dedent("""
        dataset:
          _target_: megatron.bridge.training.config.MockGPTDatasetConfig
          random_seed: 5
          sequence_length: 256
    """))
    # A Bridge target switches the dataset class; compatibility mode tolerates nothing unknown here.
    cfg = load_config("tiny", [str(other)], [])
    assert isinstance(cfg.dataset, MockGPTDatasetConfig) and cfg.dataset.random_seed == 5


def test_python_object_tags_cannot_run_code(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    for payload in (
        f"!!python/object/apply:os.system ['touch {marker}']",
        f"train: !!python/object/apply:os.system ['touch {marker}']",
        f"train:\n  train_iters: !!python/object/new:os.system ['touch {marker}']",
        "train: !!python/name:os.system",
    ):
        path = tmp_path / "evil.yaml"
        path.write_text(payload)
        with pytest.raises(ConfigError, match="not valid YAML"):
            load_config("tiny", [str(path)], [])
    assert not marker.exists()


def test_os_system_target_is_rejected_without_importing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = tmp_path / "pwned"
    import importlib

    imported: list[str] = []
    real_import = importlib.import_module
    monkeypatch.setattr(importlib, "import_module", lambda name, *a: imported.append(name) or real_import(name, *a))
    for text in (
        f"_target_: os.system\n_args_: ['touch {marker}']\n",
        f"train:\n  _target_: os.system\n  _args_: ['touch {marker}']\n",
        f"model:\n  activation_func:\n    _target_: os.system\n    _call_: true\n    _args_: ['touch {marker}']\n",
        "train:\n  _target_: megatron.bridge.training.config.TrainingConfig\n  train_iters:\n"
        f"    _target_: subprocess.call\n    _args_: ['touch {marker}']\n",
    ):
        path = tmp_path / "evil.yaml"
        path.write_text(text)
        with pytest.raises(ConfigError, match="not allowed"):
            load_config("tiny", [str(path)], [])
    assert not marker.exists()
    assert "os" not in imported and "subprocess" not in imported


def _bridge_run_config(extra_model: str = "") -> str:
    return textwrap.dedent(f"""
        _target_: megatron.bridge.training.config.ConfigContainer
        model:
          _target_: megatron.bridge.models.llama.llama_provider.Llama3ModelProvider8B
          num_layers: 4
          hidden_size: 128
          num_attention_heads: 8
          num_query_groups: 4
          ffn_hidden_size: 512
          seq_length: 256
          vocab_size: 4096
          normalization: RMSNorm
          gated_linear_unit: true
          add_bias_linear: false
          position_embedding_type: rope
          hidden_dropout: 0.0
          attention_dropout: 0.0
          params_dtype:
            _target_: torch.float32
            _call_: false
          activation_func:
            _target_: torch.nn.functional.silu
            _call_: false
          attention_backend:
            _target_: megatron.core.transformer.enums.AttnBackend
            _call_: true
            _args_: [5]
            _name_: auto
          init_method:
            _target_: torch.nn.init.normal_
            _partial_: true
            mean: 0.0
            std: 0.02
{textwrap.indent(extra_model, '          ')}
        train:
          _target_: megatron.bridge.training.config.TrainingConfig
          micro_batch_size: 2
          global_batch_size: 16
          train_iters: 10
        optimizer:
          _target_: megatron.bridge.training.config.OptimizerConfig
          lr: 0.001
          min_lr: 0.0001
        ddp:
          _target_: megatron.core.distributed.DistributedDataParallelConfig
          grad_reduce_in_fp32: true
        scheduler:
          _target_: megatron.bridge.training.config.SchedulerConfig
          lr_decay_style: cosine
          lr_warmup_iters: 2
          lr_warmup_steps: 32
          lr_decay_steps: 160
        dataset:
          _target_: megatron.bridge.training.config.GPTDatasetConfig
          random_seed: 1234
          sequence_length: 256
          split: 9999,8,2
        logger:
          _target_: megatron.bridge.training.config.LoggerConfig
          log_interval: 1
        tokenizer:
          _target_: megatron.bridge.training.tokenizers.config.TokenizerConfig
          tokenizer_type: NullTokenizer
          vocab_size: 4096
        checkpoint:
          _target_: megatron.bridge.training.config.CheckpointConfig
          save: null
    """)


def test_bridge_run_config_loads_in_compatibility_mode(tmp_path: Path) -> None:
    path = tmp_path / "run_config.yaml"
    path.write_text(_bridge_run_config("future_knob: false\n"))
    cfg = load_config(None, [str(path)], [])
    assert type(cfg.model).__name__ == "GPTModelProvider" and cfg.model.num_layers == 4
    assert cfg.model.activation_func is F.silu and cfg.model.attention_backend == "auto"
    assert cfg.ddp.grad_reduce_in_fp32 is True
    cfg.validate(world_size=1)
    assert cfg.scheduler.lr_warmup_steps == 2 * 16  # recomputed, not taken from the file


def test_bridge_unknown_fields_set_need_allow_unknown(tmp_path: Path) -> None:
    path = tmp_path / "run_config.yaml"
    path.write_text(_bridge_run_config("future_knob: 3\nanother_knob: true\n"))
    with pytest.raises(ConfigError) as err:
        load_config(None, [str(path)], [])
    message = str(err.value)
    assert "model.future_knob=3" in message and "model.another_knob=True" in message
    assert "--allow-unknown" in message and "\n" not in message
    cfg = load_config(None, [str(path)], [], allow_unknown=True)
    assert cfg.model.num_layers == 4 and not hasattr(cfg.model, "future_knob")


def test_longspan_files_are_strict(tmp_path: Path) -> None:
    path = tmp_path / "typo.yaml"
    path.write_text("_target_: longspan.training.config.ConfigContainer\ntrain:\n  train_iter: 5\n")
    with pytest.raises(ConfigError, match=r"unknown key 'train.train_iter': did you mean train_iters"):
        load_config("tiny", [str(path)], [])
