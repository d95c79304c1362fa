"""``longspan plan [--recipe NAME] [--config FILE ...] --world-size N --device h100|h200|a100|b200|cpu
--memory-per-device 80GiB [section.field=value ...]``: per-rank memory and step time of every valid layout.

Prints the model's size (parameters, active per token, model FLOPs per iteration), then one table, layouts that
fit first, each group fastest first (see ``longspan.planner.plan``).
When no layout fits, one line names the smallest per-rank need against the memory given, and it exits 2.
"""

from __future__ import annotations

import argparse
from typing import Any

from longspan.cli.common import SOURCES_SENTENCE, add_config_arguments
from longspan.core.errors import ConfigError


DESCRIPTION = ("Estimate the per-rank memory and step time of every valid layout (tensor, pipeline, context, data "
               "and expert parallel sizes) of a configuration on a world size and device. " + SOURCES_SENTENCE +
               " Prints one table, layouts that fit first, each group fastest first; when none fits, one line names "
               "the smallest per-rank need and the command exits 2.")


def add_parser(subparsers: Any, name: str) -> None:
    """Register ``longspan plan``."""
    parser = subparsers.add_parser(name, help="estimate per-rank memory and step time of every valid layout",
                                   description=DESCRIPTION)
    add_config_arguments(parser)
    parser.add_argument("--world-size", type=int, required=True, metavar="N", help="number of devices (ranks)")
    parser.add_argument("--device", default="h100", help="h100, h200, a100, b200 or cpu (default h100)")
    parser.add_argument("--memory-per-device", default="80GiB", metavar="SIZE",
                        help="memory of one device, e.g. 80GiB (default 80GiB)")
    parser.add_argument("--show-rejected", action="store_true", help="also list layouts the config rejects, and why")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # `longspan --help` must not import torch
    from longspan.data.tokenizers import build_tokenizer
    from longspan.planner.plan import GiB, format_table, parse_size, plan, summary_line
    from longspan.recipes.loading import load_config

    if args.world_size < 1:
        raise ConfigError(f"--world-size={args.world_size} must be a positive integer")
    memory = parse_size(args.memory_per_device)
    cfg = load_config(args.recipe, args.config, args.overrides, allow_unknown=args.allow_unknown)
    if cfg.model.vocab_size is None:
        cfg.model.vocab_size = build_tokenizer(cfg.tokenizer).vocab_size
    rows, rejected = plan(cfg, args.world_size, args.device.lower())
    if not rows:
        raise ConfigError(
            f"no layout of this config is valid on {args.world_size} ranks"
            + (f" (first reason: {rejected[0]})" if rejected else "")
        )
    print(summary_line(cfg))
    print(format_table(rows, memory))
    if args.show_rejected:
        for line in rejected:
            print(f"rejected: {line}")
    if not any(r.fits(memory) for r in rows):
        smallest = min(rows, key=lambda r: r.memory.total)
        L = smallest.layout
        print(f"longspan plan: no layout fits: the smallest per-rank need is {smallest.memory.total / GiB:.2f} GiB "
              f"(tp={L.tp} pp={L.pp} cp={L.cp} dp={L.dp} ep={L.ep}) against --memory-per-device "
              f"{memory / GiB:.2f} GiB")
        return 2
    return 0
