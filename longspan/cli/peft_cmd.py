"""``longspan peft merge --checkpoint CKPT --output CKPT``: fold an adapter checkpoint's LoRA/DoRA adapters into
its base and write a full longspan checkpoint (which ``convert export``, ``generate`` and ``finetune`` take like
any other)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from longspan.cli.common import add_overrides_argument
from longspan.core.errors import CheckpointError
from longspan.core.logging import is_rank_0


MERGE = ("Fold the LoRA/DoRA adapters of an adapter checkpoint into its base and write a full longspan checkpoint, "
         "which convert export, generate and finetune take like any other.")
DESCRIPTION = ("Work with the PEFT adapter checkpoints that finetune writes with the lora, dora and moe-lora recipes: "
               "merge folds the adapters into the base and writes a full longspan checkpoint.")


def add_parser(subparsers: Any, name: str) -> None:
    """Register ``longspan peft merge``."""
    parser = subparsers.add_parser(name, help="PEFT adapter checkpoints: merge adapters into the base",
                                   description=DESCRIPTION)
    actions = parser.add_subparsers(dest="action", required=True, parser_class=type(parser))
    merge = actions.add_parser("merge", help="adapter checkpoint -> full checkpoint with the adapters folded in",
                               description=MERGE)
    merge.add_argument("--checkpoint", required=True, metavar="CKPT_DIR",
                       help="adapter checkpoint: a save root (with the tracker file) or an iter_XXXXXXX directory")
    merge.add_argument("--output", required=True, metavar="CKPT_DIR", help="checkpoint directory to write")
    add_overrides_argument(merge, "overrides of single fields of the saved configuration")
    merge.set_defaults(func=run, command_name=name)


def run(args: argparse.Namespace) -> int:
    # `longspan --help` must not import torch
    from longspan.training.checkpointing.peft_checkpoint import merge_adapter_checkpoint

    if not Path(args.checkpoint).is_dir():
        raise CheckpointError(f"--checkpoint {args.checkpoint} is not a directory")
    out = merge_adapter_checkpoint(args.checkpoint, args.output, args.overrides)
    if is_rank_0():  # under a launcher every rank merges; the result is said once
        print(f"merged {args.checkpoint} -> {out}")
    return 0
