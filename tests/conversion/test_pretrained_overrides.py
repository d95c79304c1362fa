"""Values set on purpose win over what a pretrained checkpoint's config fills in, unless the weights contradict them."""

from __future__ import annotations

import logging
import textwrap
from pathlib import Path

import pytest
import yaml

from longspan.config.explicit import explicit_fields, mark_explicit
from longspan.config.overrides import apply_overrides
from longspan.core.errors import ConfigError
from longspan.recipes import get_recipe
from longspan.recipes.loading import load_config
from longspan.training.checkpointing.hf_weights import apply_hf_pretrained_config
from longspan.training.checkpointing.model_fields import merge_pretrained_model_fields
from longspan.training.pretrain import pretrain
from tests.conversion.hf_models import make_hf_model
from tests.training.pretrain_helpers import small_config


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("hf") / "llama"
    make_hf_model("llama", directory)  # hidden 32, 2 layers, 4 heads / 2 groups, no dropout in config.json
    return directory


def test_recipe_yaml_and_dotlist_settings_are_recorded(tmp_path: Path) -> None:
    override_file = tmp_path / "over.yaml"
    override_file.write_text("model:\n  attention_dropout: 0.2\ntrain:\n  train_iters: 5\n")
    cfg = load_config("tiny", [str(override_file)], ["model.hidden_dropout=0.1"])
    model = explicit_fields(cfg, "model")
    assert model["hidden_dropout"] == "override"  # 0.1 is the class default: still explicit
    assert model["attention_dropout"] == f"config file {override_file}"
    assert model["hidden_size"] == "recipe tiny" and "rotary_base" not in model  # the recipe keeps the default
    assert explicit_fields(cfg, "train")["train_iters"].startswith("config file")


def test_dropout_override_survives_an_hf_pretrained_checkpoint(tmp_path: Path, hf_dir: Path,
                                                               capsys: pytest.CaptureFixture) -> None:
    cfg = small_config(tmp_path, train_iters=1, eval_interval=100, eval_iters=0)
    cfg.checkpoint.load = None
    cfg.checkpoint.save_interval = 1
    cfg.dataset.sequence_length = cfg.model.seq_length = 32
    apply_overrides(cfg, [f"checkpoint.pretrained_checkpoint={hf_dir}", "model.hidden_dropout=0.1",
                          "model.init_method_std=0.01"])
    capsys.readouterr()
    pretrain(cfg)
    out = capsys.readouterr().out
    saved = yaml.safe_load((tmp_path / "run" / "ckpt" / "iter_0000001" / "run_config.yaml").read_text())
    assert saved["model"]["hidden_dropout"] == 0.1 and saved["model"]["init_method_std"] == 0.01
    assert saved["model"]["hidden_size"] == 32 and saved["model"]["num_layers"] == 2  # from config.json
    line = next(m for m in out.splitlines() if "is a Hugging Face model" in m)
    assert "model fields from its config.json: " in line and "hidden_size" in line.split("; kept as set")[0]
    assert "kept as set: " in line and "hidden_dropout=0.1 (override)" in line
    assert "init_method_std=0.01 (override)" in line


def test_a_contradicting_shape_stops_in_one_line(hf_dir: Path) -> None:
    cfg = get_recipe("tiny")
    apply_overrides(cfg, [f"checkpoint.pretrained_checkpoint={hf_dir}", "model.hidden_size=512"])
    with pytest.raises(ConfigError) as info:
        apply_hf_pretrained_config(cfg)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"model.hidden_size=512 (set by you, override) contradicts config.json hidden_size=32 "
                              f"in {hf_dir}")


def test_a_shape_set_in_a_yaml_file_that_matches_is_fine(tmp_path: Path, hf_dir: Path,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    override_file = tmp_path / "over.yaml"
    override_file.write_text(textwrap.dedent(f"""
        checkpoint:
          pretrained_checkpoint: {hf_dir}
        model:
          hidden_size: 32
          num_layers: 2
          rotary_base: 20000
    """))
    cfg = load_config("tiny", [str(override_file)], [])
    with caplog.at_level(logging.INFO):
        apply_hf_pretrained_config(cfg)
    assert (cfg.model.hidden_size, cfg.model.num_layers, cfg.model.ffn_hidden_size) == (32, 2, 48)
    assert cfg.model.rotary_base == 20000  # a RoPE choice of the user's (config.json says 10000)
    line = next(r.getMessage() for r in caplog.records if "is a Hugging Face model" in r.getMessage())
    assert f"rotary_base=20000 (config file {override_file})" in line


def test_a_whole_config_file_is_a_template_like_a_recipe(tmp_path: Path, hf_dir: Path) -> None:
    """``config show`` output (every field written) cannot say what was edited: its architecture yields."""
    dumped = tmp_path / "sft.yaml"
    get_recipe("sft").to_yaml(str(dumped))
    cfg = load_config(None, [str(dumped)], [f"checkpoint.pretrained_checkpoint={hf_dir}"])
    assert explicit_fields(cfg, "model")["hidden_size"] == f"config file {dumped} (whole section)"
    apply_hf_pretrained_config(cfg)
    assert (cfg.model.hidden_size, cfg.model.num_layers) == (32, 2)


def test_the_recipes_training_choices_stay_and_its_architecture_yields(hf_dir: Path) -> None:
    cfg = get_recipe("tiny")  # hidden 128, 4 layers, dropouts 0.0
    cfg.checkpoint.pretrained_checkpoint = str(hf_dir)
    cfg.model.hidden_dropout = 0.3  # Python edits after the recipe are not recorded ...
    apply_hf_pretrained_config(cfg)
    assert (cfg.model.hidden_size, cfg.model.num_layers) == (32, 2)
    assert cfg.model.attention_dropout == 0.0
    assert cfg.model.hidden_dropout == 0.3  # ... but the recipe had set hidden_dropout (0.0 != default 0.1)

    cfg = get_recipe("tiny")
    cfg.checkpoint.pretrained_checkpoint = str(hf_dir)
    cfg.model.rotary_base = 123  # not a training choice: the recipe's value yields ...
    apply_hf_pretrained_config(cfg)
    assert cfg.model.rotary_base == 10000
    cfg = get_recipe("tiny")
    cfg.checkpoint.pretrained_checkpoint = str(hf_dir)
    cfg.model.rotary_base = 123
    mark_explicit(cfg, "model.rotary_base")  # ... unless Python code marks it as its own
    apply_hf_pretrained_config(cfg)
    assert cfg.model.rotary_base == 123


def test_use_checkpoint_args_follows_the_same_rule() -> None:
    """The saved run_config.yaml's model (here: another recipe's) against explicit settings."""
    saved = get_recipe("tiny").model
    saved.hidden_dropout, saved.num_layers = 0.25, 6
    cfg = get_recipe("tiny")
    apply_overrides(cfg, ["model.attention_dropout=0.1", "model.rotary_base=5000"])
    merge = merge_pretrained_model_fields(cfg, saved, "run_config.yaml", "/ckpt", run_fields=())
    assert cfg.model.num_layers == 6 and cfg.model.hidden_dropout == 0.0  # the recipe's dropout stays
    assert cfg.model.attention_dropout == 0.1 and cfg.model.rotary_base == 5000
    assert merge.changed == ["num_layers"] and set(merge.kept) == {"hidden_dropout", "attention_dropout", "rotary_base"}
    apply_overrides(cfg, ["model.num_attention_heads=16"])
    with pytest.raises(ConfigError, match=r"^model.num_attention_heads=16 \(set by you, override\) contradicts "
                                          r"run_config.yaml num_attention_heads=8 in /ckpt"):
        merge_pretrained_model_fields(cfg, saved, "run_config.yaml", "/ckpt", run_fields=())


def test_checkpoint_tokenizer_keeps_the_fields_set_on_purpose(tmp_path) -> None:
    """A run naming no tokenizer takes the checkpoint's, but not over a tokenizer field the user set."""
    from longspan.training.checkpointing.load import _adopt_saved_tokenizer

    saved = get_recipe("tiny")
    cfg = get_recipe("tiny")
    cfg.tokenizer.tokenizer_type = None  # as the finetuning recipes leave it
    apply_overrides(cfg, ["tokenizer.chat_template=mine"])
    saved_type, saved_template = saved.tokenizer.tokenizer_type, saved.tokenizer.chat_template
    _adopt_saved_tokenizer(cfg, saved, tmp_path)
    assert cfg.tokenizer.tokenizer_type == saved_type is not None
    assert cfg.tokenizer.chat_template == "mine" != saved_template
