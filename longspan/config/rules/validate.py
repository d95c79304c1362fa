"""``ConfigContainer.validate()``: resolve defaults, derive sizes and schedule lengths, check consistency.

Every failure is one ``ConfigError`` line naming the fields, their values and what would be valid. The
function only fills values that are None (or recomputes derived ones), so calling it twice is harmless.
"""

from __future__ import annotations

import os
import signal
from typing import TYPE_CHECKING, Optional

import torch

from longspan.core.errors import ConfigError
from longspan.config.rules.data import check_dataset
from longspan.config.rules.infra import check_infra
from longspan.config.rules.model import check_model
from longspan.config.rules.layout import check_parallel_layout, check_pipeline
from longspan.config.rules.precision import (
    apply_precision,
    check_autocast,
    check_optimizer_precision_and_overlap,
    sync_distributed_optimizer,
)
from longspan.config.rules.ranges import check_ranges
from longspan.config.rules.schedule import check_batch, check_train_length, compute_scheduler_steps

if TYPE_CHECKING:
    from longspan.config.schema.container import ConfigContainer

REQUIRED_SECTIONS = ("train", "model", "optimizer", "scheduler", "dataset", "logger", "tokenizer", "checkpoint")


def resolve_world_size(world_size: Optional[int] = None) -> int:
    """The world size: explicit, else torch.distributed's when initialized, else env WORLD_SIZE (default 1)."""
    if world_size is not None:
        ws = world_size
    else:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
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


def validate_container(cfg: "ConfigContainer", world_size: Optional[int] = None) -> None:
    """Validate ``cfg`` in place for ``world_size`` ranks (see ``ConfigContainer.validate``)."""
    from longspan.config.support import check_supported
    from longspan.config.types import check_container_types

    ws = resolve_world_size(world_size)
    _check_sections(cfg)
    check_container_types(cfg)
    check_ranges(cfg)
    apply_precision(cfg)
    _resolve_defaults(cfg)
    sync_distributed_optimizer(cfg)
    check_optimizer_precision_and_overlap(cfg)
    dp = check_parallel_layout(cfg, ws)
    num_microbatches = check_batch(cfg, dp)
    check_pipeline(cfg, num_microbatches)
    check_train_length(cfg)
    compute_scheduler_steps(cfg)
    check_dataset(cfg)
    check_infra(cfg)
    check_autocast(cfg.model, via_mixed_precision=cfg.mixed_precision is not None)
    _check_recompute(cfg.model)
    check_supported(cfg)
    check_model(cfg)
    cfg.world_size = ws
    cfg.data_parallel_size = dp
    cfg.num_microbatches = num_microbatches


def _check_sections(cfg: "ConfigContainer") -> None:
    from longspan.config.targets import registered_section_types

    for name in REQUIRED_SECTIONS:
        if getattr(cfg, name) is None:
            raise ConfigError(f"the '{name}' section is missing: give it in a YAML file or start from a --recipe")
    for name, types in registered_section_types().items():
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


def _check_recompute(m: object) -> None:
    """Full recompute needs a method, and a method needs full recompute."""
    if m.recompute_granularity == "full" and m.recompute_method is None:
        raise ConfigError("model.recompute_granularity='full' needs model.recompute_method ('uniform' or 'block')")
    if m.recompute_method is not None and m.recompute_granularity != "full":
        raise ConfigError(
            f"model.recompute_method={m.recompute_method!r} needs model.recompute_granularity='full'"
        )

