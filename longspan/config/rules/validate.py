"""``ConfigContainer.validate()``: resolve defaults, derive sizes and schedule lengths, check consistency.

``VALIDATION_RULES`` is the whole validation, in the order it runs: one named rule per line. Every failure is
one ``ConfigError`` line naming the fields, their values and what would be valid. Rules only fill values that
are None (or recompute derived ones), so calling validate() twice is harmless.

The LR scheduler checks its own arguments when it is built with the rules of ``SCHEDULER_ARGUMENT_RULES``
(``longspan.config.rules.schedule``), since it can be built from values that never passed through a container.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

import torch
import torch.distributed as dist

from longspan.config.rules.comm_overlap import apply_comm_overlap
from longspan.config.rules.data import check_dataset, check_dataset_masking
from longspan.config.rules.data_parallel import (
    apply_megatron_fsdp,
    apply_sharding_strategy,
    check_distributed_optimizer_instances,
    sync_param_gather_switches,
)
from longspan.config.rules.data_hf import check_direct_hf_sft
from longspan.config.rules.device_features import check_device_features
from longspan.config.rules.infra import check_distributed_init, check_infra
from longspan.config.rules.layout import check_parallel_layout, check_pipeline
from longspan.config.rules.linear_attention import check_linear_attention_documents
from longspan.config.rules.model import check_model
from longspan.config.rules.vision import check_image_model
from longspan.config.rules.precision import (
    apply_precision,
    check_autocast,
    check_optimizer_precision_and_overlap,
    sync_distributed_optimizer,
)
from longspan.config.rules.muon import check_muon
from longspan.config.rules.optim_offload import check_optimizer_offload
from longspan.config.rules.pipeline_schedule import check_pipeline_schedule
from longspan.config.rules.ranges import check_ranges
from longspan.config.rules.run_dirs import follow_run_directory
from longspan.config.rules.schedule import check_batch, check_train_length, compute_scheduler_steps
from longspan.config.rules.scheduling_hints import check_scheduling_hints
from longspan.config.support import check_supported
from longspan.config.targets import section_types
from longspan.config.types import check_container_types
from longspan.core.errors import ConfigError
from longspan.core.logging import get_logger, print_rank_0

if TYPE_CHECKING:
    from longspan.config.schema.container import ConfigContainer

logger = get_logger(__name__)

REQUIRED_SECTIONS = ("train", "model", "optimizer", "scheduler", "dataset", "logger", "tokenizer", "checkpoint")


def resolve_world_size(world_size: Optional[int] = None) -> int:
    """The world size: explicit, else torch.distributed's when initialized, else env WORLD_SIZE (default 1)."""
    if world_size is not None:
        ws = world_size
    elif dist.is_available() and dist.is_initialized():
        ws = dist.get_world_size()
    else:
        raw = os.environ.get("WORLD_SIZE", "1")
        try:
            ws = int(raw)
        except ValueError:
            raise ConfigError(f"environment WORLD_SIZE={raw!r} is not an integer") from None
    if isinstance(ws, bool) or not isinstance(ws, int) or ws < 1:
        raise ConfigError(f"world size={ws!r} is not valid: use a positive integer")
    return ws


@dataclass
class Derived:
    """What validation derives for one launch (copied onto the container at the end)."""

    world_size: int
    data_parallel_size: int = 0
    num_microbatches: int = 0


Rule = Callable[["ConfigContainer", Derived], None]


def _set_data_parallel_size(cfg: "ConfigContainer", derived: Derived) -> None:
    derived.data_parallel_size = check_parallel_layout(cfg, derived.world_size)


def _comm_overlap(cfg: "ConfigContainer", derived: Derived) -> None:
    apply_comm_overlap(cfg, derived.data_parallel_size)
    check_optimizer_precision_and_overlap(cfg)  # again: comm_overlap may have set ddp.overlap_param_gather
def _distributed_optimizer_instances(cfg: "ConfigContainer", derived: Derived) -> None:
    check_distributed_optimizer_instances(cfg, derived.data_parallel_size)


def _set_num_microbatches(cfg: "ConfigContainer", derived: Derived) -> None:
    derived.num_microbatches = check_batch(cfg, derived.data_parallel_size)


def _pipeline(cfg: "ConfigContainer", derived: Derived) -> None:
    check_pipeline_schedule(cfg, derived.data_parallel_size, derived.num_microbatches)
    check_pipeline(cfg, derived.num_microbatches)


def _autocast(cfg: "ConfigContainer", derived: Derived) -> None:
    check_autocast(cfg.model, via_mixed_precision=cfg.mixed_precision is not None)


def _recompute(cfg: "ConfigContainer", derived: Derived) -> None:
    _check_recompute(cfg.model)


def _peft(cfg: "ConfigContainer", derived: Derived) -> None:
    if cfg.peft is not None:
        cfg.peft.validate()


def _check_image_model(cfg: "ConfigContainer") -> None:
    check_image_model(cfg.model)


def _on_config(check: Callable[["ConfigContainer"], object]) -> Rule:
    """A rule that needs only the container."""
    return lambda cfg, derived: check(cfg)


def validate_container(cfg: "ConfigContainer", world_size: Optional[int] = None) -> None:
    """Validate ``cfg`` in place for ``world_size`` ranks (see ``ConfigContainer.validate``)."""
    derived = Derived(resolve_world_size(world_size))
    for _name, rule in VALIDATION_RULES:
        rule(cfg, derived)
    cfg.world_size = derived.world_size
    cfg.data_parallel_size = derived.data_parallel_size
    cfg.num_microbatches = derived.num_microbatches


def _check_sections(cfg: "ConfigContainer") -> None:
    for name in REQUIRED_SECTIONS:
        if getattr(cfg, name) is None:
            raise ConfigError(f"the '{name}' section is missing: give it in a YAML file or start from a --recipe")
    for name, types in section_types().items():
        value = getattr(cfg, name)
        if value is not None and not isinstance(value, types):
            names = " or ".join(t.__name__ for t in types)
            raise ConfigError(f"{name} is a {type(value).__name__}: expected {names}")


def _resolve_defaults(cfg: "ConfigContainer") -> None:
    model = cfg.model
    if model.params_dtype is None:
        model.params_dtype = torch.bfloat16 if model.bf16 else torch.float16 if model.fp16 else torch.float32
    if model.pipeline_dtype is None:
        model.pipeline_dtype = model.params_dtype
    opt = cfg.optimizer
    if opt.params_dtype != model.params_dtype:
        # The model's weights decide; the optimizer's copy follows them unless it was set to something else.
        if opt.params_dtype != torch.float32:
            raise ConfigError(
                f"optimizer.params_dtype={opt.params_dtype} differs from model.params_dtype={model.params_dtype}: "
                "set both the same (mixed_precision sets both)"
            )
        opt.params_dtype = model.params_dtype
    if hasattr(model, "finalize"):
        model.finalize()
    if cfg.optimizer.min_lr is None:
        cfg.optimizer.min_lr = 0.0
    if cfg.train.exit_signal is None:
        cfg.train.exit_signal = signal.SIGTERM
    for name in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss"):
        if hasattr(cfg.dataset, name) and getattr(cfg.dataset, name) is None:
            setattr(cfg.dataset, name, False)


def is_finetuning(cfg: "ConfigContainer") -> bool:
    """The run starts from pretrained weights (checkpoint.pretrained_checkpoint / finetune) or trains adapters."""
    ckpt = cfg.checkpoint
    return bool(ckpt.pretrained_checkpoint or ckpt.finetune or cfg.peft is not None)


def _apply_finetune_lr(cfg: "ConfigContainer") -> None:
    """Bridge's ``finetune_lr``: the finetuning run's peak LR (optimizer.lr); meaningless when pretraining."""
    opt = cfg.optimizer
    value = opt.finetune_lr
    if value is None or opt.lr == value:
        return
    if not is_finetuning(cfg):
        raise ConfigError(
            f"optimizer.finetune_lr={value} applies to finetuning runs (checkpoint.pretrained_checkpoint or peft "
            f"set); this run pretrains: set optimizer.lr={value} instead"
        )
    was = "" if opt.lr is None else f" (was {opt.lr})"
    print_rank_0(f"optimizer.finetune_lr={value} sets optimizer.lr for this finetuning run{was}", logger)
    opt.lr = value


def _check_recompute(m: object) -> None:
    """Full recompute needs a method, and a method needs full recompute."""
    if m.recompute_granularity == "full" and m.recompute_method is None:
        raise ConfigError("model.recompute_granularity='full' needs model.recompute_method ('uniform' or 'block')")
    if m.recompute_method is not None and m.recompute_granularity != "full":
        raise ConfigError(
            f"model.recompute_method={m.recompute_method!r} needs model.recompute_granularity='full'"
        )



# The whole validation, in order. Later rules rely on what earlier ones resolved (defaults, the data-parallel
# size, the number of microbatches).
VALIDATION_RULES: list[tuple[str, Rule]] = [
    ("sections present and of an accepted class", _on_config(_check_sections)),
    ("field types", _on_config(check_container_types)),
    ("numeric ranges (RANGE_RULES)", _on_config(check_ranges)),
    ("optimizer.finetune_lr -> optimizer.lr when finetuning", _on_config(_apply_finetune_lr)),
    ("mixed-precision recipe copied onto model, optimizer, ddp", _on_config(apply_precision)),
    ("defaults: dtypes, min_lr, exit signal, dataset flags", _on_config(_resolve_defaults)),
    ("ddp.use_megatron_fsdp: FSDP2 in Megatron-FSDP's place, its conflicts", _on_config(apply_megatron_fsdp)),
    ("ddp.data_parallel_sharding_strategy -> data-parallel mode", _on_config(apply_sharding_strategy)),
    ("distributed optimizer flags in sync", _on_config(sync_distributed_optimizer)),
    ("parameter all-gather switches in sync (overlap, fp8)", _on_config(sync_param_gather_switches)),
    ("optimizer precision and overlap", _on_config(check_optimizer_precision_and_overlap)),
    ("optimizer CPU offload", _on_config(check_optimizer_offload)),
    ("Muon optimizer", _on_config(check_muon)),
    ("parallel layout -> data-parallel size", _set_data_parallel_size),
    ("comm_overlap section onto model, ddp, optimizer", _comm_overlap),
    ("distributed optimizer instances (hybrid sharding)", _distributed_optimizer_instances),
    ("global batch -> number of microbatches", _set_num_microbatches),
    ("pipeline split and schedule", _pipeline),
    ("training length (iterations from samples)", _on_config(check_train_length)),
    ("scheduler step counts", _on_config(compute_scheduler_steps)),
    ("a template's log directory follows the run's checkpoint.save", _on_config(follow_run_directory)),
    ("dataset", _on_config(check_dataset)),
    ("masked-LM (T5) data: masking choices", _on_config(check_dataset_masking)),
    ("direct HF SFT data: sources, blend, preprocessing", _on_config(check_direct_hf_sft)),
    ("infrastructure and resilience", _on_config(check_infra)),
    ("dist: lazy_init's CPU initialization, use_sharp's backend", _on_config(check_distributed_init)),
    ("autocast", _autocast),
    ("activation recompute", _recompute),
    ("activation offload and device features", _on_config(check_device_features)),
    ("Megatron's rules of compute-scheduling hints", _on_config(check_scheduling_hints)),
    ("fields longspan does not support yet", _on_config(check_supported)),
    ("model architecture (what the GPT, Mamba or T5 model can build)", _on_config(check_model)),
    ("a vision-language model's image fields", _on_config(_check_image_model)),
    ("gated DeltaNet layers: how packed documents reach them", _on_config(check_linear_attention_documents)),
    ("PEFT adapters", _peft),
]
