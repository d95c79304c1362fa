"""Bad data met in the first hour: one line naming the file and line, exit 2, no traceback, nothing left behind."""

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


@pytest.mark.parametrize("workers,partitions", [(1, 1), (2, 1), (1, 3)])
def test_null_tokenizer_on_words_names_the_line_and_leaves_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture, workers: int, partitions: int
) -> None:
    lines = ['{"text": "%d %d 3"}' % (i % 7, i % 5) for i in range(300)]
    lines[200] = '{"text": "hello world"}'
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    out.mkdir()
    code = main(["preprocess", "--input", str(tmp_path / "in.jsonl"), "--output-prefix", str(out / "data"),
                 "--tokenizer-type", "NullTokenizer", "--vocab-size", "16", "--no-progress",
                 "--workers", str(workers), "--partitions", str(partitions)])
    _assert_one_line(code, capsys.readouterr().err,
                     f"{tmp_path / 'in.jsonl'}:201 (key 'text'): NullTokenizer expects space-separated integer "
                     "token ids, got 'hello'")
    assert list(out.iterdir()) == []


def test_null_tokenizer_on_plain_text_names_the_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "in.txt").write_text("1 2 3\n4 5\nThe quick brown fox\n")
    code = main(["preprocess", "--input", str(tmp_path / "in.txt"), "--output-prefix", str(tmp_path / "data"),
                 "--tokenizer-type", "NullTokenizer", "--vocab-size", "16", "--append-eod"])
    _assert_one_line(code, capsys.readouterr().err, f"{tmp_path / 'in.txt'}:3 (key 'text'): NullTokenizer expects")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt"]


def test_bad_json_line_mid_preprocess_removes_partial_outputs(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    lines = ['{"text": "1 2 3"}'] * 500 + ["{not json"]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    code = main(["preprocess", "--input", str(tmp_path / "in.jsonl"), "--output-prefix", str(tmp_path / "data"),
                 "--tokenizer-type", "NullTokenizer", "--vocab-size", "16", "--no-progress"])
    _assert_one_line(code, capsys.readouterr().err, f"{tmp_path / 'in.jsonl'}:501 is not valid JSON")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]
