"""``longspan ... --help`` reads as plain, complete text, and the command line takes what its usage line shows.

Every parser of the command (each subcommand and sub-subcommand) is checked: a description of whole sentences
(ending in a full stop, so none is a docstring's first line cut mid-sentence), no reST markup, no line that
argparse's wrapping ended inside a hyphenated word (an option name such as --nproc-per-node cut in two).
"""

from __future__ import annotations

import argparse
import re

import pytest

from longspan.cli import _parse, build_parser, main


def all_parsers() -> dict[str, argparse.ArgumentParser]:
    """Every parser of ``longspan``, by its command line (``longspan``, ``longspan config show``, ...)."""
    found: dict[str, argparse.ArgumentParser] = {}
    pending = [build_parser()]
    while pending:
        parser = pending.pop()
        found[parser.prog] = parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                pending.extend(action.choices.values())
    return found


PARSERS = all_parsers()


def test_every_command_has_a_parser() -> None:
    assert {"longspan pretrain", "longspan finetune", "longspan config show", "longspan config validate",
            "longspan preprocess", "longspan generate", "longspan convert import", "longspan convert export",
            "longspan plan", "longspan peft", "longspan peft merge"} <= set(PARSERS)


@pytest.mark.parametrize("prog", sorted(PARSERS))
def test_help_is_complete_plain_text(prog: str) -> None:
    parser = PARSERS[prog]
    description = parser.description or ""
    assert description.endswith("."), f"{prog}: the description is not a complete sentence: {description!r}"
    text = parser.format_help()
    assert "``" not in text and ":func:" not in text and ":data:" not in text, text
    for line in text.splitlines():
        assert not re.search(r"\w-$", line), f"{prog}: argparse cut a hyphenated word: {line!r}"
    for action in parser._actions:
        assert action.help is None or not action.help.endswith((",", ";", " and", " or")), (prog, action.help)


@pytest.mark.parametrize("argv", [["peft", "--help"], ["config", "show", "--help"], ["--help"]])
def test_help_prints_and_exits_zero(argv: list[str], capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    out = capsys.readouterr().out
    assert exit_info.value.code == 0 and out.startswith("usage: longspan")
    if argv[0] == "peft":
        assert "merge folds the adapters into the base and writes a full longspan checkpoint." in " ".join(out.split())


@pytest.mark.parametrize("prog", ["longspan config show", "longspan config validate", "longspan pretrain",
                                  "longspan plan", "longspan peft merge", "longspan convert import"])
def test_usage_lines_show_the_overrides(prog: str) -> None:
    assert "[section.field=value ...]" in PARSERS[prog].format_usage()


@pytest.mark.parametrize("argv,expected", [
    (["config", "show", "a.b=1", "--recipe", "tiny", "c.d=2"], ["a.b=1", "c.d=2"]),
    (["config", "validate", "--recipe", "tiny", "a.b=1", "--world-size", "2", "c.d=2"], ["a.b=1", "c.d=2"]),
    (["pretrain", "a.b=1", "--recipe", "tiny", "c.d=2", "--config", "x.yaml", "e.f=3"], ["a.b=1", "c.d=2", "e.f=3"]),
])
def test_overrides_are_taken_anywhere_on_the_line_in_order(argv: list[str], expected: list[str]) -> None:
    assert _parse(build_parser(), argv).overrides == expected


@pytest.mark.parametrize("argv,message", [
    (["pretrain", "--recipee", "tiny"], "longspan: error: unrecognized arguments: --recipee"),
    (["generate", "--checkpoint", "c", "--prompt", "p", "stray"], "longspan: error: unrecognized arguments: stray"),
    (["convert", "import", "--hf-model", "x"], "longspan convert import: error: the following arguments are "
                                              "required: --output"),
])
def test_argument_errors_are_one_line_naming_the_command(argv: list[str], message: str,
                                                         capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err == message + "\n"


def test_recipe_names_are_shown_with_hyphens_and_accepted_either_way(capsys: pytest.CaptureFixture) -> None:
    from longspan.recipes import get_recipe, list_recipes

    assert all("_" not in name for name in list_recipes())
    assert "tiny-moe" in list_recipes() and "llama3-8b" in list_recipes()
    assert get_recipe("tiny_moe").to_yaml() == get_recipe("tiny-moe").to_yaml()
    assert main(["config", "show", "--recipe", "tiny_moee"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("longspan: error: unknown recipe 'tiny_moee': did you mean tiny-moe? choose one of tiny, ")
    assert "_" not in err.split("choose one of", 1)[1]
    assert "tiny-moe" in PARSERS["longspan pretrain"].format_help()
