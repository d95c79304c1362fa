"""``longspan generate``: JSON output equals the Python function; user errors are one line with exit code 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from longspan.cli import main
from longspan.inference import generate
from longspan.training.checkpointing.model_loading import load_model_from_checkpoint
from tests.inference.helpers import train_tiny_checkpoint

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root, _, _ = train_tiny_checkpoint(tmp_path_factory.mktemp("cli"), iters=3)
    return root


def _run(capsys, argv):
    capsys.readouterr()
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_json_output_equals_the_python_function(checkpoint, capsys):
    loaded = load_model_from_checkpoint(checkpoint)
    for extra, kwargs in (([], {}), (["--temperature", "0.8", "--top-k", "50", "--top-p", "0.9", "--seed", "3"],
                                     {"temperature": 0.8, "top_k": 50, "top_p": 0.9, "seed": 3})):
        code, out, _ = _run(capsys, ["generate", "--checkpoint", str(checkpoint), "--prompt", "def f1(x):",
                                     "--max-new-tokens", "12", "--json", *extra])
        assert code == 0
        payload = json.loads(out)  # stdout holds the JSON line only (loading messages go to stderr)
        assert set(payload) == {"prompt_ids", "output_ids", "text"}
        expected = generate(loaded.model, loaded.tokenizer, "def f1(x):", max_new_tokens=12, **kwargs)
        assert payload["prompt_ids"] == expected.prompt_ids == loaded.tokenizer.tokenize("def f1(x):")
        assert payload["output_ids"] == expected.output_ids and payload["text"] == expected.text
        assert 1 <= len(payload["output_ids"]) <= 12


def test_plain_output_is_the_text_and_iter_dir_works(checkpoint, capsys):
    code, out, _ = _run(capsys, ["generate", "--checkpoint", str(checkpoint / "iter_0000003"), "--prompt", "line 3",
                                 "--max-new-tokens", "6", "--no-cache"])
    assert code == 0
    loaded = load_model_from_checkpoint(checkpoint)
    assert out == generate(loaded.model, loaded.tokenizer, "line 3", max_new_tokens=6).text + "\n"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--checkpoint", "{missing}", "--prompt", "x"], "does not exist"),
        (["--prompt", "x"], "one of the arguments --checkpoint --hf-model is required"),
        (["--checkpoint", "{ckpt}", "--hf-model", "{ckpt}", "--prompt", "x"], "not allowed with argument"),
        (["--checkpoint", "{ckpt}", "--prompt", ""], "--prompt is empty"),
        (["--checkpoint", "{ckpt}", "--prompt", "x", "--temperature", "-1"], "temperature=-1.0"),
        (["--checkpoint", "{ckpt}", "--prompt", "x", "--top-p", "0"], "top_p=0.0"),
        (["--checkpoint", "{ckpt}", "--prompt", "x", "--top-k", "-2"], "top_k=-2"),
        (["--checkpoint", "{ckpt}", "--prompt", "x", "--top-k", "two"], "invalid int value"),
        (["--hf-model", "{missing}", "--prompt", "x"], "is not a directory"),
        (["--checkpoint", "{ckpt}", "--prompt", "x", "--device", "gpu9"], "is not a device"),
        (["--hf-model", "{ckpt}", "--prompt", "x"], "has no config.json"),
    ],
)
def test_user_errors_are_one_line_exit_2(checkpoint, tmp_path, capsys, argv, message):
    argv = [a.format(ckpt=checkpoint, missing=tmp_path / "missing") for a in argv]
    capsys.readouterr()
    try:
        code = main(["generate", *argv])
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    out = capsys.readouterr()
    assert code == 2
    assert out.out == ""
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], out.err
    assert "Traceback" not in out.err


def test_refuses_a_multi_process_launch(checkpoint, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    code, out, err = _run(capsys, ["generate", "--checkpoint", str(checkpoint), "--prompt", "x"])
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "runs on one process" in err


@pytest.mark.slow
def test_readme_quickstart_then_generate(tmp_path):
    """``longspan pretrain --recipe tiny`` (2 iterations here) then ``longspan generate --checkpoint
    runs/tiny/checkpoints --prompt "def "`` in a fresh process, from the run directory."""
    overrides = ["train.train_iters=2", "train.eval_iters=0", "checkpoint.save_interval=2",
                 "scheduler.lr_warmup_fraction=null", "scheduler.lr_warmup_iters=1", "train.global_batch_size=2"]
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert main(["pretrain", "--recipe", "tiny", *overrides]) == 0
    finally:
        os.chdir(cwd)
    assert (tmp_path / "runs/tiny/checkpoints/latest_checkpointed_iteration.txt").read_text().strip() == "2"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "longspan", "generate", "--checkpoint", "runs/tiny/checkpoints", "--prompt", "def ",
         "--max-new-tokens", "16", "--json"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    payload = json.loads(proc.stdout)
    assert payload["prompt_ids"] and 1 <= len(payload["output_ids"]) <= 16
    assert isinstance(payload["text"], str)
