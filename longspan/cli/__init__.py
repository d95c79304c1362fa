"""The ``longspan`` command: ``pretrain | finetune | preprocess | config ...``.

Each subcommand lives in its own module with ``add_parser(subparsers)`` and ``run(args) -> int``. User errors
(``LongspanError``) become one line on stderr and exit code 2; anything else is a bug and keeps its traceback.

May import: every other package (the top layer).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from longspan.core.errors import LongspanError

# subcommand name -> module under longspan.cli
_SUBCOMMANDS = {
    "pretrain": "longspan.cli.pretrain_cmd",
    "finetune": "longspan.cli.pretrain_cmd",
    "config": "longspan.cli.config_cmd",
    "preprocess": "longspan.cli.preprocess_cmd",
    "generate": "longspan.cli.generate_cmd",
    "convert": "longspan.cli.convert_cmd",
    "plan": "longspan.cli.plan_cmd",
    "peft": "longspan.cli.peft_cmd",
}


class _Parser(argparse.ArgumentParser):
    """argparse that reports bad arguments as one line with exit code 2 (argparse's own code)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"longspan {self.prog.split()[-1]}: error: {message}\n")
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="longspan", description=__doc__.splitlines()[0])
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


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(argv) if argv is not None else sys.argv[1:]
    try:
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
