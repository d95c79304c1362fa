"""The README works as written: its command blocks run in order on a fresh copy of the repository, CI runs its
test command, and it lists every recipe.

Which blocks run: every fenced ``bash`` and ``python`` block, top to bottom, in a temporary copy of the
repository's files, except a block whose line above is ``<!-- readme-test: skip (why) -->`` (it needs files
of the reader's own, such as a Hugging Face model directory). Install steps (``python3 -m venv``, activating
it, ``pip``) and the test command (``python -m pytest``) are left out: the test already runs in an installed
environment. ``longspan`` commands without shell syntax run in this process (``longspan.cli.main``); the
others (a redirect, say) run through bash with ``longspan`` on the PATH.

Runs are shortened by the same factor everywhere, so that the order of iteration counts between the README's
runs holds (a later example that trains fewer iterations than the quickstart would still resume and fail if
it shared its checkpoint directory): each ``longspan pretrain|finetune`` gets ``train.train_iters`` set to a
hundredth of what it would train (rounded up), and each ``train_iters = N`` in a Python block becomes N/100.
A training command that trains nothing (it resumed a finished run) fails the test as an error would.
"""

from __future__ import annotations

import math
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from longspan.cli import _parse, build_parser, main
from longspan.recipes import list_recipes
from longspan.recipes.loading import load_config

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
SKIP_MARK = re.compile(r"^<!-- readme-test: skip \((?P<why>[^)]+)\) -->$")
RUNNABLE = ("bash", "python")
SHORTEN_BY = 100
SHELL_OPERATORS = {">", ">>", "<", "|", "||", ";", "&"}


@dataclass
class Block:
    language: str
    text: str
    line: int  # 1-based line of the opening fence
    skip_reason: str | None


def readme_blocks(text: str) -> list[Block]:
    """Every fenced block of a Markdown text, with its language and skip marker."""
    lines = text.splitlines()
    blocks: list[Block] = []
    start: int | None = None
    for i, line in enumerate(lines):
        if not line.startswith("```"):
            continue
        if start is None:
            start = i
            continue
        marker = SKIP_MARK.match(lines[start - 1].strip()) if start else None
        blocks.append(Block(lines[start][3:].strip(), "\n".join(lines[start + 1:i]), start + 1,
                            marker.group("why") if marker else None))
        start = None
    assert start is None, f"README.md:{start + 1}: a fence is never closed"
    return blocks


def shell_commands(text: str) -> list[list[str]]:
    """The commands of a bash block as token lists: continuations joined, comments dropped, split at ``&&``."""
    commands: list[list[str]] = []
    for line in text.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|<>")
        lexer.whitespace_split = True
        command: list[str] = []
        for token in lexer:
            if token == "&&":
                commands.append(command)
                command = []
            else:
                command.append(token)
        if command:
            commands.append(command)
    return commands


def is_install_or_test_step(command: list[str]) -> bool:
    """Creating or activating the environment, pip, or the test suite itself."""
    return (command[0] in ("pip", "pip3", ".", "source") or command[:3] in (["python3", "-m", "venv"],
            ["python", "-m", "venv"]) or command[:3] == ["python", "-m", "pytest"])


def shortened(iterations: int) -> int:
    return max(1, math.ceil(iterations / SHORTEN_BY))


def shorten_run(argv: list[str]) -> list[str]:
    """A ``longspan pretrain|finetune`` line that trains a hundredth of the iterations it would (later wins)."""
    args = _parse(build_parser(), argv)
    cfg = load_config(args.recipe, args.config, args.overrides, allow_unknown=args.allow_unknown)
    return [*argv, f"train.train_iters={shortened(cfg.train.train_iters)}", "train.eval_iters=1"]


def shorten_python(code: str) -> str:
    runs = len(re.findall(r"\b(pretrain|finetune)\(", code))
    code, assigned = re.subn(r"(\btrain_iters\s*=\s*)(\d+)", lambda m: f"{m[1]}{shortened(int(m[2]))}", code)
    assert assigned >= runs, "a Python block that trains must set train_iters, so that this test can shorten it"
    return code


def copy_of_repository(dest: Path) -> Path:
    """The repository's files (as a fresh clone has them) under ``dest``."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True)
    if listed.returncode == 0:
        for name in filter(None, listed.stdout.decode().split("\0")):
            source = REPO / name
            if source.is_file():
                (dest / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, dest / name)
    else:  # not a git checkout (an unpacked archive): everything but local outputs
        shutil.copytree(REPO, dest, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns(".git", ".venv*", "runs", "__pycache__", "*.egg-info"))
    return dest


def longspan_on_path(bin_dir: Path) -> dict[str, str]:
    """An environment whose ``longspan`` (and ``python``) is this interpreter running this checkout."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    script = bin_dir / "longspan"
    script.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m longspan "$@"\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    path = os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return {**os.environ, "PATH": path, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def run_command(command: list[str], cwd: Path, env: dict[str, str], capsys: pytest.CaptureFixture) -> str | None:
    """Run one README command; None when it succeeded, else what went wrong."""
    if command[0] == "longspan" and not SHELL_OPERATORS & set(command):
        argv = command[1:]
        if argv[0] in ("pretrain", "finetune"):
            argv = shorten_run(argv)
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse's own errors
            code = exc.code
        out = capsys.readouterr()
        if code == 0 and argv[0] in ("pretrain", "finetune") and "nothing to train" in out.out:
            return f"it trained nothing (a README run that resumes a finished one): {out.out[-3000:]}"
        return None if code == 0 else f"exit {code}: {(out.out + out.err)[-3000:]}"
    line = " ".join(t if t in SHELL_OPERATORS else shlex.quote(t) for t in command)
    done = subprocess.run(["bash", "-c", line], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    return None if done.returncode == 0 else f"exit {done.returncode}: {(done.stdout + done.stderr)[-3000:]}"


def run_python(code: str, name: str, capsys: pytest.CaptureFixture) -> str | None:
    try:
        exec(compile(shorten_python(code), name, "exec"), {"__name__": "__readme__"})
    except BaseException as exc:  # noqa: BLE001 - any failure of the snippet is the finding
        return f"{type(exc).__name__}: {exc}\n{capsys.readouterr().err[-3000:]}"
    capsys.readouterr()
    return None


@pytest.mark.slow
def test_readme_blocks_run_in_order_on_a_fresh_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture) -> None:
    work = copy_of_repository(tmp_path / "clone")
    env = longspan_on_path(tmp_path / "bin")
    monkeypatch.chdir(work)
    ran = 0
    for block in readme_blocks(README.read_text()):
        if block.language not in RUNNABLE or block.skip_reason:
            continue
        where = f"README.md:{block.line}"
        if block.language == "python":
            failure = run_python(block.text, where, capsys)
            assert failure is None, f"{where}: the Python block failed: {failure}"
            ran += 1
            continue
        for command in shell_commands(block.text):
            if is_install_or_test_step(command):
                continue
            failure = run_command(command, work, env, capsys)
            assert failure is None, f"{where}: `{shlex.join(command)}` failed: {failure}"
            ran += 1
    assert ran >= 9  # the quickstart and its continuation, two generations, config show/validate, another run,
    # the Python snippet, the multi-process run


def test_readme_blocks_are_parsed_as_a_shell_would() -> None:
    text = 'longspan a --x "two words" \\\n    b=1 # note\npip install x && longspan c > out.yaml\n'
    assert shell_commands(text) == [["longspan", "a", "--x", "two words", "b=1"], ["pip", "install", "x"],
                                     ["longspan", "c", ">", "out.yaml"]]
    blocks = readme_blocks("x\n<!-- readme-test: skip (needs a model) -->\n```bash\nls\n```\n```python\npass\n```\n")
    assert [(b.language, b.text, b.line, b.skip_reason) for b in blocks] == [
        ("bash", "ls", 3, "needs a model"), ("python", "pass", 6, None)]
    assert shorten_python("cfg.train.train_iters = 250\npretrain(cfg)") == "cfg.train.train_iters = 3\npretrain(cfg)"
    with pytest.raises(AssertionError, match="must set train_iters"):
        shorten_python("pretrain(cfg)")


def test_every_readme_block_is_runnable_or_says_why_not() -> None:
    """A shell block is bash (so the test runs it) and each skipped block gives its reason; every command of a
    runnable bash block is an install step or a longspan command."""
    blocks = readme_blocks(README.read_text())
    assert {b.language for b in blocks} <= set(RUNNABLE), "fence README blocks as bash or python"
    assert sum(1 for b in blocks if not b.skip_reason) >= 5
    for block in blocks:
        if block.language == "bash" and not block.skip_reason:
            for command in shell_commands(block.text):
                assert is_install_or_test_step(command) or command[0] == "longspan", (block.line, command)


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    marker = ci.index("# --- the README's test command, verbatim ---")
    command = ci[marker + 1]
    tests_blocks = [b for b in readme_blocks(README.read_text()) if "python -m pytest" in b.text]
    assert len(tests_blocks) == 1 and tests_blocks[0].text.strip() == command


def test_readme_install_keeps_torch_a_choice_of_the_machine() -> None:
    """The CPU path takes torch from PyTorch's CPU index, and no constraints file of the README pins torch."""
    text = README.read_text()
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in text
    pins = [line.split("==")[0].strip().lower() for line in (REPO / "constraints.txt").read_text().splitlines()
            if line.strip() and not line.startswith("#")]
    assert "torch" not in pins


def test_readme_lists_every_recipe_with_the_spelling_the_cli_shows() -> None:
    text = README.read_text()
    section = text[text.index("## Recipes"):]
    section = section[:section.index("\n## ", 1)]
    listed = re.findall(r"^- `([\w-]+)`:", section, flags=re.M)
    assert sorted(listed) == sorted(list_recipes()) and len(set(listed)) == len(listed)
    for name in set(re.findall(r"--recipe[ =]([\w-]+)", text)) - {"NAME"}:
        assert name in list_recipes(), f"README names recipe {name!r}; the CLI shows {list_recipes()}"
