"""What a new user meets in the first hour: each bad input is one line naming the field and the fix, exit 2,
no traceback, nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest

from longspan.cli import main


def _assert_one_line(code: int, err: str, fragment: str) -> None:
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1, err
    assert lines[0].startswith("longspan"), lines[0]
    assert fragment in lines[0], lines[0]
    assert "Traceback" not in err


@pytest.mark.parametrize("recipe", ["lora", "sft"])
def test_finetune_without_pretrained_checkpoint_names_the_field(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, recipe: str
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    code = main(["finetune", "--recipe", recipe, f"dataset.dataset_root={tmp_path / 'data'}"])
    _assert_one_line(code, capsys.readouterr().err,
                     "finetune needs checkpoint.pretrained_checkpoint: give checkpoint.pretrained_checkpoint=DIR, "
                     f"an HF model directory or a longspan checkpoint to start from (checkpoint.load=runs/{recipe}/"
                     "checkpoints holds no run to resume yet)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]


def test_unset_tokenizer_type_names_where_it_comes_from() -> None:
    from types import SimpleNamespace

    from longspan.core.errors import ConfigError
    from longspan.data.tokenizers import build_tokenizer

    with pytest.raises(ConfigError, match=r"tokenizer.tokenizer_type is not set: set it \(HuggingFaceTokenizer.*\) or "
                                          r"give checkpoint.pretrained_checkpoint=DIR"):
        build_tokenizer(SimpleNamespace(tokenizer_type=None, tokenizer_model=None))
