"""A ``longspan`` process imports its trainer with the garbage collector paused and freezes the module objects;
a caller's own process (``main(argv)`` from Python) is left as it was."""

from __future__ import annotations

import gc
import importlib
import subprocess
import sys

from longspan.cli import _IMPORTS, _SUBCOMMANDS, main

# a fresh interpreter importing torch alone holds ~250k objects; the trainer adds more
MANY_OBJECTS = 100_000


def _fresh(code: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return out.stdout.split()


def test_import_frozen_freezes_what_it_imported_and_keeps_the_collector_state() -> None:
    enabled, frozen, disabled_stays = _fresh(
        "import gc\n"
        "from longspan.core.startup import import_frozen\n"
        "import_frozen(['json'])\n"
        "a = (gc.isenabled(), gc.get_freeze_count())\n"
        "gc.disable(); import_frozen(['torch'])\n"
        "print(a[0], gc.get_freeze_count() - a[1], not gc.isenabled())\n")
    assert enabled == "True" and int(frozen) > MANY_OBJECTS and disabled_stays == "True"


def test_the_command_line_freezes_its_imports_and_a_caller_of_main_keeps_its_objects_unfrozen() -> None:
    # `python -m longspan` reads sys.argv: the process is the command's
    (frozen,) = _fresh(
        "import gc, io, sys, contextlib\n"
        "sys.argv = ['longspan', 'config', 'show', '--recipe', 'tiny']\n"
        "from longspan.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    assert main() == 0\n"
        "print(gc.get_freeze_count())\n")
    assert int(frozen) > MANY_OBJECTS
    before = gc.get_freeze_count()
    assert main(["config", "show", "--recipe", "tiny"]) == 0
    assert gc.get_freeze_count() <= before  # frozen objects freed by reference counting leave the count


def test_every_subcommand_names_modules_that_exist() -> None:
    assert set(_IMPORTS) == set(_SUBCOMMANDS)
    for names in _IMPORTS.values():
        for name in names:
            importlib.import_module(name)
