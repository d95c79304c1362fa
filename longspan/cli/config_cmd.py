"""``longspan config show|validate [--recipe NAME] [--config FILE]... [--world-size N] [--allow-unknown] [overrides]``.

``show`` prints the merged configuration as YAML (recipe < files < overrides; nothing is validated, so the
output loads back byte for byte). ``validate`` runs ``ConfigContainer.validate()`` for the world size and
prints the derived values.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from longspan.cli.common import SOURCES_SENTENCE, add_config_arguments


DESCRIPTION = "Show or validate the configuration a run would use. " + SOURCES_SENTENCE
SHOW = ("Print the merged configuration as YAML. Nothing is validated, so the output loads back unchanged "
        "with --config.")
VALIDATE = ("Validate the merged configuration for a world size, as a run would before its first step, and print "
            "the derived values (data-parallel size, microbatches, schedule lengths).")


def add_parser(subparsers: Any, name: str) -> None:
    """Register ``longspan config show|validate``."""
    parser = subparsers.add_parser(name, help="show or validate a configuration", description=DESCRIPTION)
    actions = parser.add_subparsers(dest="config_action", required=True, parser_class=type(parser))
    for action, short, text in (("show", "print the merged configuration as YAML", SHOW),
                                ("validate", "validate the configuration for a world size", VALIDATE)):
        sub = actions.add_parser(action, help=short, description=text)
        add_config_arguments(sub, config_help="YAML file: a full config or a partial override "
                                              "(repeatable; later wins)")
        if action == "validate":
            sub.add_argument("--world-size", type=int, default=None, metavar="N",
                             help="number of ranks to validate for (default: WORLD_SIZE or 1)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run ``config show`` or ``config validate``; user errors raise ConfigError (exit 2 in the dispatcher)."""
    # `longspan --help` must not import torch (config and recipes do)
    from longspan.config import inapplicable_fields
    from longspan.recipes.loading import load_config

    cfg = load_config(args.recipe, args.config, args.overrides, allow_unknown=args.allow_unknown)
    if args.config_action == "show":
        sys.stdout.write(cfg.to_yaml())
        return 0
    cfg.validate(world_size=args.world_size)
    s = cfg.scheduler
    lines = [
        f"configuration is valid for world size {cfg.world_size}",
        f"  data_parallel_size: {cfg.data_parallel_size}",
        f"  num_microbatches: {cfg.num_microbatches}",
        f"  global_batch_size: {cfg.train.global_batch_size}",
        f"  lr_warmup_steps: {s.lr_warmup_steps}",
        f"  lr_decay_steps: {s.lr_decay_steps}",
        f"  wd_incr_steps: {s.wd_incr_steps}",
        f"  wsd_decay_steps: {s.wsd_decay_steps}",
    ]
    skipped = inapplicable_fields(cfg)
    if skipped:
        lines.append(f"not applicable on this machine (ignored): {', '.join(skipped)}")
    sys.stdout.write("\n".join(lines) + "\n")
    return 0
