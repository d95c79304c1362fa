"""``longspan convert import|export``: Hugging Face models to longspan checkpoints and back.

``convert import --hf-model DIR --output CKPT_DIR [--config F.yaml] [section.field=value ...]`` writes a
longspan checkpoint at iteration 0 (weights, run_config.yaml, tokenizer files, tracker) that ``pretrain`` /
``finetune`` load as ``checkpoint.pretrained_checkpoint``; the model comes from the HF directory alone, no
recipe is read (``AutoBridge.import_ckpt``). ``convert export --checkpoint CKPT_DIR --output
HF_DIR`` writes config.json + safetensors + tokenizer files for ``transformers``. Both take the layout as
``pretrain`` does (``model.tensor_model_parallel_size=2`` ...) and ``--nproc-per-node N`` for large models:
each rank then reads (import) or gathers (export) only its own part, one tensor at a time.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from longspan.cli.common import add_overrides_argument
from longspan.cli.pretrain_cmd import _strip_launch_args
from longspan.core.errors import CheckpointError, ConfigError
from longspan.core.logging import is_rank_0


LAYOUT = ("The layout is given as for pretrain (model.tensor_model_parallel_size=2 ...); with --nproc-per-node N "
          "each rank reads or writes only its own part, one tensor at a time.")
DESCRIPTION = "Convert Hugging Face models to longspan checkpoints and back. " + LAYOUT
IMPORT = ("Write a longspan checkpoint at iteration 0 (weights, run_config.yaml, tokenizer files) from a Hugging "
          "Face model directory; pretrain and finetune load it as checkpoint.pretrained_checkpoint. The model comes "
          "from the HF directory alone: no recipe is read. " + LAYOUT)
EXPORT = ("Write a Hugging Face model directory (config.json, safetensors, tokenizer files) that transformers "
          "loads, from a longspan checkpoint. An adapter checkpoint is merged into its base, or written as an HF PEFT "
          "adapter with --adapter-only. " + LAYOUT)


def add_parser(subparsers: Any, name: str) -> None:
    """Register ``longspan convert import|export``."""
    parser = subparsers.add_parser(name, help="convert Hugging Face models to longspan checkpoints and back",
                                   description=DESCRIPTION)
    actions = parser.add_subparsers(dest="action", required=True, parser_class=type(parser))
    imp = actions.add_parser("import", help="HF model directory -> longspan checkpoint (iteration 0)",
                             description=IMPORT)
    imp.add_argument("--hf-model", required=True, metavar="DIR", help="HF model directory (config.json + safetensors)")
    imp.add_argument("--output", required=True, metavar="CKPT_DIR", help="longspan checkpoint directory to write")
    exp = actions.add_parser("export", help="longspan checkpoint -> HF model directory", description=EXPORT)
    exp.add_argument("--checkpoint", required=True, metavar="CKPT_DIR",
                     help="longspan checkpoint: a save root (with the tracker file) or an iter_XXXXXXX directory")
    exp.add_argument("--output", required=True, metavar="HF_DIR", help="HF model directory to write")
    exp.add_argument("--architecture", default=None, metavar="NAME",
                     help="HF architecture to export as, an `architectures` name of config.json (default: the one the "
                          "checkpoint was imported from or its model was built as, else the one its fields match)")
    exp.add_argument("--adapter-only", action="store_true",
                     help="write only the PEFT adapters as an HF PEFT adapter directory")
    for sub in (imp, exp):
        sub.add_argument("--config", action="append", default=[], metavar="FILE",
                         help="YAML file with the layout (repeatable; later wins)")
        sub.add_argument("--nproc-per-node", type=int, default=None, metavar="N",
                         help="start N worker processes on this node")
        sub.add_argument("--no-progress", action="store_true", help="no progress bar / progress lines")
        add_overrides_argument(sub, "overrides of single fields, e.g. model.tensor_model_parallel_size=2 (the layout)")
        sub.set_defaults(func=run, command_name=name)


def run(args: argparse.Namespace) -> int:
    if args.action == "import":
        _check_dir(args.hf_model, "--hf-model")
    else:
        _check_dir(args.checkpoint, "--checkpoint")
    if args.nproc_per_node:
        return _launch(args)
    if args.action == "export" and args.adapter_only:
        return _export_adapter(args)
    # function level: `longspan --help` does not load the model stack
    from longspan.training.checkpointing.hf_checkpoint import auto_bridge

    AutoBridge = auto_bridge()
    overrides = [*_yaml_as_dotlist(args.config), *args.overrides]
    if args.action == "import":
        AutoBridge.import_ckpt(args.hf_model, args.output, overrides, show_progress=not args.no_progress)
        _report(f"imported {args.hf_model} -> {args.output}")
    else:
        AutoBridge.export_checkpoint(args.checkpoint, args.output, overrides, architecture=args.architecture,
                                     show_progress=not args.no_progress)
        _report(f"exported {args.checkpoint} -> {args.output}")
    return 0


def _export_adapter(args: argparse.Namespace) -> int:
    """The adapters of an adapter checkpoint in HF PEFT format (longspan.training.checkpointing.peft_checkpoint)."""
    # `longspan --help` must not import torch
    from longspan.training.checkpointing.peft_checkpoint import export_adapter_checkpoint

    export_adapter_checkpoint(args.checkpoint, args.output, args.overrides, architecture=args.architecture)
    _report(f"exported adapters of {args.checkpoint} -> {args.output}")
    return 0


def _report(line: str) -> None:
    """The command's result, once per job: every rank of a launch runs this command, rank 0 says it."""
    if is_rank_0():
        print(line)


def _yaml_as_dotlist(files: list[str]) -> list[str]:
    """``--config`` files as dotlist overrides (``section.field=v``) of the configuration derived from the HF
    directory (import) or saved in the checkpoint (export)."""
    # `longspan --help` must not import torch (config does)
    from longspan.config import load_yaml_file

    out = []
    for path in files:
        data = load_yaml_file(path) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"--config {path}: expected a mapping of sections")
        for section, fields in data.items():
            if not isinstance(fields, dict):
                raise ConfigError(f"--config {path}: section {section!r} is not a mapping")
            for key, value in fields.items():
                out.append(f"{section}.{key}={value if isinstance(value, str) else json.dumps(value)}")
    return out


def _check_dir(path: str, flag: str) -> None:
    if not Path(path).is_dir():
        raise CheckpointError(f"{flag} {path}: no such directory")


def _launch(args: argparse.Namespace) -> int:
    # `longspan --help` loads only the parsers
    from longspan.parallel.launcher import launch

    _check_layout_before_launch(args)
    return launch(_strip_launch_args(args.argv), nproc_per_node=args.nproc_per_node)


def _check_layout_before_launch(args: argparse.Namespace) -> None:
    """The layout against ``--nproc-per-node`` ranks, as pretrain checks it before any worker starts: the model
    read from the HF directory (import) or the checkpoint's run_config.yaml (export), the overrides applied."""
    # `longspan --help` must not import torch
    from longspan.parallel.mesh import check_layout

    overrides = [*_yaml_as_dotlist(args.config), *args.overrides]
    if args.action == "import":
        # `longspan --help` must not import torch
        from longspan.conversion.checkpoints import import_config
        from longspan.training.checkpointing.hf_checkpoint import auto_bridge

        bridge = auto_bridge().from_hf_pretrained(args.hf_model)
        cfg = import_config(bridge._provider(), args.hf_model, args.output, overrides)
    else:
        # `longspan --help` must not import torch
        from longspan.training.checkpointing.model_loading import load_checkpoint_config

        cfg = load_checkpoint_config(args.checkpoint, overrides).cfg
    check_layout(args.nproc_per_node, cfg.model, use_tp_pp_dp_mapping=cfg.dist.use_tp_pp_dp_mapping)
