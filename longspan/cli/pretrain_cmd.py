"""``longspan pretrain|finetune [--recipe NAME] [--config FILE.yaml ...] [section.field=value ...]``.

With ``--nproc-per-node N`` the configuration is validated for the whole world size first, then the
workers are started through torch's elastic launcher in-process (see ``longspan.parallel.launcher``), or, with
``inprocess_restart.enabled``, under longspan's in-process restart supervisor
(``longspan.training.resilience.supervisor``), which replaces a failed rank without restarting the others.
"""

from __future__ import annotations

import argparse
import copy
import os
from typing import Any, Optional

from longspan.cli import distill_cmd
from longspan.cli.common import SOURCES_SENTENCE, add_config_arguments
from longspan.core.errors import ConfigError, LaunchError, NotSupportedError


DESCRIPTIONS = {
    "pretrain": "Pretrain a model. " + SOURCES_SENTENCE + " Rerunning the same command resumes from the last "
                "checkpoint (checkpoint.load); give another checkpoint.save and checkpoint.load, or "
                "checkpoint.load=null, to start fresh.",
    "finetune": "Finetune a model from checkpoint.pretrained_checkpoint, a Hugging Face model directory or a "
                "longspan checkpoint (recipes such as sft, lora and dora). "
                + SOURCES_SENTENCE + " Rerunning the same command resumes from the last checkpoint.",
}
DESCRIPTIONS["distill"] = distill_cmd.DESCRIPTION
LAUNCH = ("With --nproc-per-node N the configuration is checked for the whole world size first, then N workers are "
          "started on this node (torch's elastic launcher); torchrun and srun work too.")


def add_parser(subparsers: Any, name: str) -> None:
    """Register ``longspan pretrain``, ``longspan finetune`` or ``longspan distill`` (the same options; distill adds
    the teacher's)."""
    parser = subparsers.add_parser(name, help=f"{name} a model from a recipe, YAML files and dotlist overrides",
                                   description=f"{DESCRIPTIONS[name]} {LAUNCH}")
    add_config_arguments(parser)
    if name == "distill":
        distill_cmd.add_distill_arguments(parser)
        parser.set_defaults(recipe=distill_cmd.DEFAULT_RECIPE)
    parser.add_argument("--callbacks", action="append", default=[], metavar="MODULE:NAME",
                        help="training callbacks (repeatable; longspan.training.callbacks): a Callback subclass or "
                             "instance, a list of them, or a CallbackManager, imported from MODULE")
    launch = parser.add_argument_group("launching workers")
    launch.add_argument("--nproc-per-node", type=int, default=None, metavar="N",
                        help="start N worker processes on this node")
    launch.add_argument("--nnodes", default="1", metavar="N|MIN:MAX",
                        help="number of nodes (or MIN:MAX) when launching workers (default 1)")
    launch.add_argument("--node-rank", type=int, default=0, metavar="RANK",
                        help="this node's rank when launching workers (default 0)")
    launch.add_argument("--rdzv-backend", default="c10d", metavar="BACKEND",
                        help="rendezvous backend for multi-node launches (default c10d)")
    launch.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT", help="address of the rendezvous")
    launch.add_argument("--rdzv-id", default="longspan", metavar="ID",
                        help="rendezvous id shared by every node of the job (default longspan)")
    launch.add_argument("--max-restarts", type=int, default=0, metavar="N",
                        help="restart the worker group up to N times after a worker fails or hangs (torchrun's flag)")
    launch.add_argument("--ft-initial-rank-heartbeat-timeout", type=float, default=None, metavar="S",
                        help="fault tolerance: seconds a rank may take from start-up to its first iteration "
                             "(default 3600)")
    launch.add_argument("--ft-rank-heartbeat-timeout", type=float, default=None, metavar="S",
                        help="fault tolerance: seconds a rank may go without a heartbeat after that (default 2700)")
    parser.set_defaults(func=run, command_name=name)


def _strip_launch_args(argv: list[str]) -> list[str]:
    """The worker command line: this one without the launcher's own options."""
    launch_opts = {"--nproc-per-node", "--nnodes", "--node-rank", "--rdzv-backend", "--rdzv-endpoint", "--rdzv-id",
                   "--max-restarts", "--ft-initial-rank-heartbeat-timeout", "--ft-rank-heartbeat-timeout"}
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        key = arg.split("=", 1)[0]
        if key in launch_opts:
            skip = "=" not in arg
            continue
        out.append(arg)
    return out


def run(args: argparse.Namespace) -> int:
    # `longspan --help` must not import torch
    from longspan.recipes.loading import load_config
    from longspan.training.resilience.inprocess import in_supervised_worker

    def fresh_config() -> Any:
        return load_config(args.recipe, args.config, args.overrides, allow_unknown=args.allow_unknown)

    cfg = fresh_config()
    if in_supervised_worker():  # started by the in-process restart supervisor: train, restarting in place
        from longspan.training.resilience.inprocess import run_worker

        return run_worker(lambda c: _train(args, c), fresh_config)
    in_worker = "TORCHELASTIC_RUN_ID" in os.environ  # started by a launcher (ours or torchrun): train here
    if cfg.inprocess_restart is not None and cfg.inprocess_restart.enabled:
        if in_worker:
            raise NotSupportedError("inprocess_restart.enabled=True needs longspan's own supervisor: start the run "
                                    "with longspan pretrain [--nproc-per-node N], not torchrun")
        return _launch_inprocess(args, cfg)
    if args.nproc_per_node or (not in_worker and (args.max_restarts or (cfg.ft is not None and cfg.ft.enable_ft_package))):
        return _launch(args, cfg)  # restarts and fault tolerance need the launcher, also for one process
    return _train(args, cfg)


def _train(args: argparse.Namespace, cfg: Any) -> int:
    from longspan.training.callbacks import callbacks_from_specs  # `longspan --help` must not import torch

    callbacks = callbacks_from_specs(args.callbacks)
    if args.command_name == "distill":
        state = distill_cmd.distill_from_args(args, cfg, callbacks)
    elif args.command_name == "finetune":
        from longspan.training.finetune import finetune  # `longspan --help` must not import torch

        state = finetune(cfg, callbacks=callbacks)
    else:
        from longspan.training.pretrain import pretrain  # `longspan --help` must not import torch

        state = pretrain(cfg, callbacks=callbacks)
    return int(getattr(state, "exit_code", None) or 0)


def _validate_for_launch(args: argparse.Namespace, cfg: Any, workload_world_size: Optional[int] = None) -> int:
    """Check the configuration for the whole world size (``workload_world_size`` when some processes are warm
    reserves) before any worker starts; return the world size."""
    # `longspan --help` loads only the parsers
    from longspan.parallel.mesh import check_layout

    args.nproc_per_node = args.nproc_per_node or 1
    nnodes = int(str(args.nnodes).split(":")[-1])
    world_size = workload_world_size or nnodes * args.nproc_per_node
    check_layout(world_size, cfg.model, use_tp_pp_dp_mapping=cfg.dist.use_tp_pp_dp_mapping)
    # `longspan --help` must not import torch
    from longspan.config.rules.data import check_vocab_fits
    from longspan.data.tokenizers import build_tokenizer, model_vocab_size
    from longspan.training.checkpointing.hf_weights import apply_hf_pretrained_config
    from longspan.training.checkpointing.load import apply_checkpoint_args

    # As setup() does in each worker: architecture and tokenizer from the pretrained checkpoint, on a copy (the
    # workers build their own config from the command line).
    cfg = copy.deepcopy(cfg)
    if cfg.checkpoint.use_checkpoint_args:
        apply_checkpoint_args(cfg)
    apply_hf_pretrained_config(cfg)
    tokenizer = build_tokenizer(cfg.tokenizer)
    tokenizer_vocab_size = tokenizer.vocab_size
    if cfg.model.vocab_size is None:
        cfg.model.vocab_size = model_vocab_size(tokenizer, cfg.tokenizer)
    cfg.validate(world_size=world_size)
    check_vocab_fits(cfg.model.vocab_size, tokenizer_vocab_size)
    return world_size


def _launch_inprocess(args: argparse.Namespace, cfg: Any) -> int:
    """inprocess_restart.enabled: one node's workers under longspan's in-process restart supervisor."""
    if str(args.nnodes) != "1" or args.rdzv_endpoint is not None:
        raise NotSupportedError(f"inprocess_restart.enabled=True with --nnodes={args.nnodes} is not supported yet: "
                                "the in-process supervisor runs one node (use --nnodes 1)")
    if args.max_restarts:
        raise LaunchError(f"--max-restarts={args.max_restarts} restarts the whole worker group; with "
                          "inprocess_restart.enabled=True use inprocess_restart.max_iterations instead")
    processes = args.nproc_per_node or 1
    active = cfg.inprocess_restart.active_world_size
    if active is not None and not 1 <= active <= processes:
        raise ConfigError(f"inprocess_restart.active_world_size={active} is not valid: use 1 to {processes} (the "
                          f"--nproc-per-node processes; those beyond it are warm reserves)")
    world_size = _validate_for_launch(args, cfg, workload_world_size=active)
    # `longspan --help` must not import torch
    from longspan.training.observability.loggers import metrics_jsonl_path
    from longspan.training.resilience.supervisor import InProcessSupervisor, supervisor_reporter

    ipr = cfg.inprocess_restart
    report = supervisor_reporter(cfg.checkpoint.save, metrics_jsonl_path(cfg), world_size, ipr.monitor_process_logdir)
    return InProcessSupervisor(_strip_launch_args(args.argv), processes, ipr, report).run()


def _launch(args: argparse.Namespace, cfg: Any) -> int:
    from longspan.parallel.launcher import launch  # `longspan --help` loads only the parsers

    world_size = _validate_for_launch(args, cfg)
    worker_argv = _strip_launch_args(args.argv)
    from longspan.training.resilience.launch import fault_tolerance_monitor  # `longspan --help` must not import torch

    with fault_tolerance_monitor(cfg, args, world_size) as ft_env:
        return launch(
            worker_argv,
            nproc_per_node=args.nproc_per_node,
            nnodes=str(args.nnodes),
            rdzv_backend=args.rdzv_backend,
            rdzv_endpoint=args.rdzv_endpoint,
            node_rank=args.node_rank,
            rdzv_id=args.rdzv_id,
            max_restarts=args.max_restarts,
            extra_env=ft_env,
        )
