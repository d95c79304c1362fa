"""The ``longspan`` command: ``pretrain | finetune | distill | config | preprocess | generate | convert | plan | peft``.

Each subcommand lives in its own module with ``add_parser(subparsers)`` and ``run(args) -> int``. User errors
(``LongspanError``) become one line on stderr and exit code 2; anything else is a bug and keeps its traceback.

May import: every other package (the top layer).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import textwrap
from typing import Any

from longspan.core.errors import LongspanError
from longspan.core.startup import import_frozen

# subcommand name -> module under longspan.cli
_SUBCOMMANDS = {
    "pretrain": "longspan.cli.pretrain_cmd",
    "finetune": "longspan.cli.pretrain_cmd",
    "distill": "longspan.cli.pretrain_cmd",
    "config": "longspan.cli.config_cmd",
    "preprocess": "longspan.cli.preprocess_cmd",
    "generate": "longspan.cli.generate_cmd",
    "convert": "longspan.cli.convert_cmd",
    "plan": "longspan.cli.plan_cmd",
    "peft": "longspan.cli.peft_cmd",
}

# subcommand name -> the heavy modules its run imports, loaded first through ``core.startup.import_frozen``
_IMPORTS = {
    "pretrain": ("longspan.training.pretrain",),
    "finetune": ("longspan.training.finetune",),
    "distill": ("longspan.training.distill",),
    "config": ("longspan.recipes.loading",),
    "preprocess": ("longspan.data.preprocess",),
    "generate": ("longspan.inference",),
    "convert": ("longspan.training.checkpointing.hf_checkpoint",),
    "plan": ("longspan.planner.plan",),
    "peft": ("longspan.training.checkpointing.peft_checkpoint",),
}


DESCRIPTION = ("Megatron Bridge's training layer on PyTorch's own distributed engine: train, finetune, convert "
               "and generate from the command line. Each command explains itself with --help.")


class _HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter, wrapping at spaces only: option names like --nproc-per-node are never cut."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False, break_long_words=False)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return textwrap.fill(" ".join(text.split()), width, initial_indent=indent, subsequent_indent=indent,
                             break_on_hyphens=False, break_long_words=False)


class _Parser(argparse.ArgumentParser):
    """argparse that reports bad arguments as one line with exit code 2 (argparse's own code)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    """The ``longspan`` parser with every subcommand (no torch import: ``--help`` stays fast)."""
    parser = _Parser(prog="longspan", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, module_name in _SUBCOMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:
                continue  # subcommand not built yet
            raise
        module.add_parser(sub, name)
    return parser


def _parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse the line; ``section.field=value`` tokens after later options join the command's overrides."""
    args, extras = parser.parse_known_args(argv)
    if extras and hasattr(args, "overrides") and not any(e.startswith("-") for e in extras):
        args.overrides = [*(args.overrides or []), *extras]
    elif extras:
        parser.error(f"unrecognized arguments: {' '.join(extras)}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run one ``longspan`` command; returns its exit code (2 for a user error, reported as one line)."""
    parser = build_parser()
    args = _parse(parser, argv)
    args.argv = list(argv) if argv is not None else sys.argv[1:]
    try:
        if argv is None:  # the process is this command's own: a caller's objects are never frozen
            import_frozen(_IMPORTS[args.command])
        return int(args.func(args) or 0)
    except LongspanError as exc:
        from longspan.core.logging import get_world_size  # error path only: `import longspan.cli` stays light

        if get_world_size() > 1:  # under torchrun/srun every rank hits the same error: print it once
            from longspan.parallel.init import report_user_error_once

            return report_user_error_once(exc)
        sys.stderr.write(f"longspan: error: {exc}\n")
        return exc.exit_code
    except KeyboardInterrupt:
        sys.stderr.write("longspan: interrupted\n")
        return 130


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
