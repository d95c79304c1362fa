"""Precision and optimizer rules of ``ConfigContainer.validate()``: the ``mixed_precision`` recipe and the
model/optimizer dtype flags, autocast, the distributed optimizer flag, precision-aware optimizer and
``overlap_param_gather``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from longspan.config.schema.optim import (
    MIXED_PRECISION_RECIPES,
    MixedPrecisionConfig,
    apply_mixed_precision,
    check_overlap_param_gather,
    check_precision_aware_optimizer,
    get_mixed_precision_config,
)
from longspan.core.errors import ConfigError

if TYPE_CHECKING:
    from longspan.config.schema.container import ConfigContainer


def apply_precision(cfg: "ConfigContainer") -> None:
    """Apply ``mixed_precision`` (a recipe name or config) to model/optimizer/ddp, else require their flags agree."""
    model, opt = cfg.model, cfg.optimizer
    mp = cfg.mixed_precision
    if isinstance(mp, str):
        resolved = get_mixed_precision_config(mp)
        if resolved is None:
            raise ConfigError(
                f"mixed_precision={mp!r} is not a known recipe: choose one of {', '.join(MIXED_PRECISION_RECIPES)}"
            )
        mp = resolved
    if isinstance(mp, MixedPrecisionConfig):
        if sum([mp.fp32, mp.fp16, mp.bf16]) > 1:
            raise ConfigError(
                f"mixed_precision sets fp32={mp.fp32}, fp16={mp.fp16}, bf16={mp.bf16}: choose exactly one"
            )
        apply_mixed_precision(mp, model, opt, cfg.ddp)
    else:
        # One source of truth: without mixed_precision the model and optimizer flags must agree.
        for flag in ("bf16", "fp16"):
            if bool(getattr(model, flag)) != bool(getattr(opt, flag)):
                raise ConfigError(
                    f"model.{flag}={getattr(model, flag)} but optimizer.{flag}={getattr(opt, flag)}: "
                    f"set both the same, or set mixed_precision (bf16_mixed, fp16_mixed, fp32)"
                )
    if model.fp16 and model.bf16:
        raise ConfigError("model.fp16=True and model.bf16=True: choose one (or neither for fp32)")


def sync_distributed_optimizer(cfg: "ConfigContainer") -> None:
    """``optimizer.use_distributed_optimizer`` decides; it is copied to ``ddp`` (which may not contradict it)."""
    opt_flag, ddp_flag = cfg.optimizer.use_distributed_optimizer, cfg.ddp.use_distributed_optimizer
    if ddp_flag and not opt_flag:
        raise ConfigError(
            "ddp.use_distributed_optimizer=True but optimizer.use_distributed_optimizer=False: "
            "set optimizer.use_distributed_optimizer=true (it is copied to ddp)"
        )
    cfg.ddp.use_distributed_optimizer = opt_flag


def check_optimizer_precision_and_overlap(cfg: "ConfigContainer") -> None:
    """Megatron's rules for the precision-aware optimizer fields and ddp.overlap_param_gather."""
    fsdp2 = bool(cfg.dist.use_torch_fsdp2)
    check_precision_aware_optimizer(cfg.optimizer, cfg.ddp, fsdp2)
    check_overlap_param_gather(cfg.ddp, cfg.optimizer.use_distributed_optimizer, fsdp2)


def check_autocast(m: object, via_mixed_precision: bool) -> None:
    """Autocast runs in bf16 or fp16 (torch.autocast's dtypes); a dtype without autocast on changes nothing."""
    enable, dtype = "model.enable_autocast", "model.autocast_dtype"
    if via_mixed_precision:
        enable, dtype = "mixed_precision.autocast_enabled", "mixed_precision.autocast_dtype"
    if not m.enable_autocast:
        if m.autocast_dtype is not None and not via_mixed_precision:
            raise ConfigError(f"{dtype}={m.autocast_dtype} has no effect without {enable}=true: set both or neither")
        return
    resolved = m.autocast_dtype or m.pipeline_dtype
    if resolved not in (torch.bfloat16, torch.float16):
        raise ConfigError(
            f"{enable}=True runs torch.autocast in {resolved} ({dtype}={m.autocast_dtype}, else the pipeline "
            f"dtype): set {dtype} to torch.bfloat16 or torch.float16"
        )
