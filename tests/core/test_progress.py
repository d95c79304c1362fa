"""Progress reports: a bar redrawn with '\\r' only on a terminal; log files, pipes and CI get plain lines every 10%.
Every progress report of longspan goes through longspan.core.progress (HF import/export, preprocess)."""

from __future__ import annotations

import ast
import io
import json
import re
from pathlib import Path

import pytest

from longspan.cli import main
from longspan.core.progress import Progress

ROOT = Path(__file__).resolve().parents[2] / "longspan"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_lines_every_ten_percent_off_a_terminal() -> None:
    stream = io.StringIO()
    meter = Progress(40, "import", "tensors", stream=stream)
    for _ in range(40):
        meter.advance()
    meter.close()
    text = stream.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert [re.match(r"import \[ *([0-9.]+)%\] (\d+)/40 tensors \| ", m).group(2) for m in lines] == [
        str(n) for n in range(4, 41, 4)]
    assert lines[-1].startswith("import [100.0%] 40/40 tensors | ") and "ETA" not in lines[-1]


def test_a_terminal_gets_one_line_redrawn_in_place() -> None:
    stream = _Terminal()
    meter = Progress(5, "export", "tensors", stream=stream, refresh_s=0.0)
    for _ in range(5):
        meter.advance()
    meter.close()
    text = stream.getvalue()
    assert text.count("\r") >= 5 and text.endswith("\n") and text.count("\n") == 1
    assert text.rstrip("\n").split("\r")[-1].startswith("export [100.0%] 5/5 tensors")


def test_stopped_early_and_disabled_and_empty() -> None:
    stream = io.StringIO()
    meter = Progress(100, "x", stream=stream)
    meter.update(55)
    meter.close()  # an error stopped it: no claim of 100%
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("x [ 55.0%] 55/100 items | ")
    quiet = io.StringIO()
    off = Progress(10, "x", stream=quiet, enabled=False)
    off.advance(10)
    off.close()
    assert quiet.getvalue() == ""
    empty = io.StringIO()
    Progress(0, "x", stream=empty).close()
    assert empty.getvalue().startswith("x [100.0%] 0/0")


def test_convert_and_preprocess_write_no_carriage_return_to_a_log(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture) -> None:
    from tests.conversion.hf_models import make_hf_model

    make_hf_model("llama", tmp_path / "hf")
    capsys.readouterr()
    assert main(["convert", "import", "--hf-model", str(tmp_path / "hf"), "--output", str(tmp_path / "ckpt")]) == 0
    assert main(["convert", "export", "--checkpoint", str(tmp_path / "ckpt"), "--output", str(tmp_path / "out")]) == 0
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": " ".join(str(i % 200) for i in range(n))}) + "\n"
                              for n in range(3, 300)))
    assert main(["preprocess", "--input", str(corpus), "--output-prefix", str(tmp_path / "c"), "--tokenizer-type",
                 "NullTokenizer", "--vocab-size", "255", "--append-eod"]) == 0
    captured = capsys.readouterr()
    assert "\r" not in captured.err and "\r" not in captured.out
    err = captured.err.splitlines()
    for desc in ("import", "export"):
        assert any(m.startswith(f"{desc} [100.0%]") and "tensors" in m for m in err), err
    assert any(m.startswith("preprocess [100.0%]") and "297 documents" in m for m in err), err


def _carriage_returns(tree: ast.AST) -> bool:
    """Whether a string literal (f-strings included) holds a lone '\\r' (a frame drawn over the last one)."""
    return any(isinstance(node, ast.Constant) and isinstance(node.value, str)
               and re.search(r"\r(?!\n)", node.value) for node in ast.walk(tree))


def test_no_progress_bar_outside_the_helper() -> None:
    """tqdm and hand-written '\\r' frames write garbage into log files; longspan.core.progress decides."""
    offenders = []
    for path in ROOT.rglob("*.py"):
        if path == ROOT / "core" / "progress.py":
            continue
        text = path.read_text()
        if re.search(r"^\s*(from|import) tqdm", text, re.M) or _carriage_returns(ast.parse(text)):
            offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []
