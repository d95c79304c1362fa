"""What a new user meets in the first hour: each bad input is one line naming the field and the fix, exit 2,
no traceback, nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest

from longspan.cli import main
from tests.helpers.cli_errors import assert_one_line


@pytest.mark.parametrize("recipe", ["lora", "sft"])
def test_finetune_without_pretrained_checkpoint_names_the_field(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, recipe: str
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    code = main(["finetune", "--recipe", recipe, f"dataset.dataset_root={tmp_path / 'data'}"])
    assert_one_line(code, capsys.readouterr().err,
                     "finetune needs checkpoint.pretrained_checkpoint: give checkpoint.pretrained_checkpoint=DIR, "
                     f"an HF model directory or a longspan checkpoint to start from (checkpoint.load=runs/{recipe}/"
                     "checkpoints holds no run to resume yet)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]


def test_unset_tokenizer_type_names_where_it_comes_from() -> None:
    from longspan.config.schema.data import TokenizerConfig
    from longspan.core.errors import ConfigError
    from longspan.data.tokenizers import build_tokenizer

    with pytest.raises(ConfigError, match=r"tokenizer.tokenizer_type is not set: set it \(HuggingFaceTokenizer.*\) or "
                                          r"give checkpoint.pretrained_checkpoint=DIR"):
        build_tokenizer(TokenizerConfig(tokenizer_type=None, tokenizer_model=None))


def _small_yaml(tmp_path: Path, **logger: object) -> tuple[Path, Path]:
    from tests.training.pretrain_helpers import small_config

    cfg = small_config(tmp_path, "run", train_iters=2)
    for key, value in logger.items():
        setattr(cfg.logger, key, value)
    path = tmp_path / "base.yaml"
    path.write_text(cfg.to_yaml())
    return path, tmp_path / "run"


@pytest.mark.parametrize("given", ["uri", "environment"])
def test_mlflow_file_store_refusal_is_one_line_with_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, given: str
) -> None:
    pytest.importorskip("mlflow")  # an optional client (the test extras install it)
    from mlflow.tracking._tracking_service import utils as tracking_utils

    monkeypatch.setattr(tracking_utils, "_tracking_uri", None)  # a URI set by an earlier test in this process
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    monkeypatch.chdir(tmp_path)
    uri = (tmp_path / "mlruns").as_uri()
    fields = {"mlflow_experiment": "first-contact", "mlflow_run_name": "r"}
    if given == "uri":
        fields["mlflow_tracking_uri"] = uri
    else:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    config, run_dir = _small_yaml(tmp_path, **fields)
    before = sorted(p.name for p in tmp_path.iterdir())
    code = main(["pretrain", "--config", str(config)])
    where = f"logger.mlflow_tracking_uri={uri}" if given == "uri" else f"MLflow's tracking URI {uri}"
    err = capsys.readouterr().err
    assert_one_line(code, err, f"{where} is a file store, which MLflow ")
    assert ("opens only with MLFLOW_ALLOW_FILE_STORE=true in the environment; set it, or use a database, e.g. "
            "logger.mlflow_tracking_uri=sqlite:///mlflow.db") in err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # refused at start-up: no run directory either


# --- optimizer.finetune_lr (Megatron Bridge's recipe argument) ------------------------------------------------


def test_finetune_lr_sets_lr_when_finetuning_with_a_notice(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from longspan.recipes.finetune import lora

    cfg = lora()
    cfg.optimizer.finetune_lr = 5e-5
    with caplog.at_level(logging.INFO, logger="longspan"):
        cfg.validate(world_size=1)
    assert cfg.optimizer.lr == 5e-5
    notices = [r.getMessage() for r in caplog.records if "finetune_lr" in r.getMessage()]
    assert notices == ["optimizer.finetune_lr=5e-05 sets optimizer.lr for this finetuning run (was 0.0001)"]
    caplog.clear()
    cfg.validate(world_size=1)  # validating again changes nothing and says nothing
    assert cfg.optimizer.lr == 5e-5 and not [r for r in caplog.records if "finetune_lr" in r.getMessage()]


def test_finetune_lr_in_a_bridge_style_override_file_loads(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    override = tmp_path / "override.yaml"
    override.write_text("optimizer:\n  finetune_lr: 2.0e-5\n")
    assert main(["config", "validate", "--recipe", "lora", "--config", str(override)]) == 0
    assert "configuration is valid" in capsys.readouterr().out


def test_finetune_lr_in_pretraining_is_one_line(capsys: pytest.CaptureFixture) -> None:
    code = main(["config", "validate", "--recipe", "tiny", "optimizer.finetune_lr=1e-4"])
    assert_one_line(code, capsys.readouterr().err,
                     "optimizer.finetune_lr=0.0001 applies to finetuning runs (checkpoint.pretrained_checkpoint or "
                     "peft set); this run pretrains: set optimizer.lr=0.0001 instead")


def test_finetune_lr_out_of_range_is_one_line(capsys: pytest.CaptureFixture) -> None:
    code = main(["config", "validate", "--recipe", "lora", "optimizer.finetune_lr=-1"])
    assert_one_line(code, capsys.readouterr().err, "optimizer.finetune_lr=-1")


def test_a_short_lora_run_fits_the_recipes_warmup_and_a_users_warmup_is_checked_in_iterations() -> None:
    """The finetuning recipes warm up for Bridge's 50 iterations; ``train.train_iters=20`` fits that template
    to 5% of the run with one line, while a warmup the user gives is checked as given, in iterations."""
    import logging

    from longspan.core.errors import ConfigError
    from longspan.recipes.loading import load_config

    records: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = _Keep(level=logging.WARNING)
    logging.getLogger("longspan").addHandler(handler)
    try:
        cfg = load_config("lora", (), ["train.train_iters=20"])
        cfg.validate(world_size=1)
        cfg.validate(world_size=1)  # said once: the fitted value fits
    finally:
        logging.getLogger("longspan").removeHandler(handler)
    assert cfg.scheduler.lr_warmup_iters == 1 and cfg.scheduler.lr_warmup_steps == 1 * cfg.train.global_batch_size
    assert [r for r in records if "lr_warmup_iters" in r] == [
        "scheduler.lr_warmup_iters: the recipe lora's warmup of 50 iterations does not fit a decay of 20 "
        "(train.train_iters or scheduler.lr_decay_iters): warming up for 1 (5%); set scheduler.lr_warmup_iters to "
        "choose"]
    assert load_config("lora", (), []).validate(world_size=1) is None  # the recipe's own 1000 keep 50
    cfg = load_config("lora", (), ["train.train_iters=20", "scheduler.lr_warmup_iters=50"])
    with pytest.raises(ConfigError, match=r"^scheduler warmup \(50 iterations\) is not shorter than the decay "
                                          r"\(20 iterations\)"):
        cfg.validate(world_size=1)
