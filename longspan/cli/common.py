"""Arguments several commands share: where the configuration comes from (recipe, YAML files, overrides).

Help texts here are plain sentences: argparse prints them as they are written, so they carry no reST markup.
Importing this module must stay light (no torch): ``longspan --help`` builds every parser.
"""

from __future__ import annotations

import argparse

# Examples only: the list lives in longspan.recipes (importing it loads torch), and an unknown name lists them all.
RECIPE_HELP = ("recipe to start from, e.g. tiny, tiny-moe or lora (underscores work too; "
               "a wrong name lists every recipe)")
OVERRIDES_HELP = "overrides of single fields, e.g. train.train_iters=100 (anywhere on the line; later wins)"
SOURCES_SENTENCE = ("The configuration is built from a recipe, then the YAML files in order, then the "
                    "section.field=value overrides; later sources win.")


def add_config_arguments(parser: argparse.ArgumentParser, *, config_help: str = "YAML file (repeatable; later wins)",
                         overrides_help: str = OVERRIDES_HELP) -> None:
    """--recipe, --config, --allow-unknown and the positional ``section.field=value`` overrides."""
    parser.add_argument("--recipe", default=None, metavar="NAME", help=RECIPE_HELP)
    parser.add_argument("--config", action="append", default=[], metavar="FILE", help=config_help)
    parser.add_argument("--allow-unknown", action="store_true",
                        help="load Megatron Bridge files even when they set fields longspan does not know")
    add_overrides_argument(parser, overrides_help)


def add_overrides_argument(parser: argparse.ArgumentParser, help_text: str = OVERRIDES_HELP) -> None:
    """The positional overrides; ``longspan.cli.main`` also collects those that follow later options."""
    parser.add_argument("overrides", nargs="*", metavar="section.field=value", help=help_text)
