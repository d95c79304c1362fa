"""``longspan distill --teacher DIR [--recipe distill] [KD options] [section.field=value ...]``.

The student comes from the recipe, YAML files and overrides as ``longspan pretrain``'s model does (default recipe
``distill``); ``--teacher`` names the teacher's weights (an HF model directory or a longspan checkpoint), whose
architecture is read from them. Launching (``--nproc-per-node``, torchrun, srun) is ``longspan pretrain``'s.
"""

from __future__ import annotations

import argparse
from typing import Any, Optional

from longspan.core.errors import ConfigError

DESCRIPTION = ("Distill a teacher (an HF model directory or a longspan checkpoint, --teacher) into the student "
               "model of the recipe (default: distill), YAML files and overrides: the teacher is frozen and laid "
               "out like the student, the loss is the KL divergence of the two models' logits (plus the LM loss with "
               "--no-skip-lm-loss). Only the student is saved.")
DEFAULT_RECIPE = "distill"


def add_distill_arguments(parser: argparse.ArgumentParser) -> None:
    """The teacher and the KD settings (``ModelOptDistillConfig``'s fields)."""
    kd = parser.add_argument_group("distillation")
    kd.add_argument("--teacher", required=True, metavar="DIR",
                    help="the teacher's weights: an HF model directory or a longspan checkpoint (its architecture "
                         "is read from it; its vocabulary must be the student's)")
    kd.add_argument("--logit-kl-temperature", type=float, default=1.0, metavar="T",
                    help="both models' logits are divided by T before the KL divergence (default 1.0)")
    kd.add_argument("--no-skip-lm-loss", dest="skip_lm_loss", action="store_false",
                    help="add the student's LM loss to the distillation loss (default: the distillation loss alone)")
    kd.add_argument("--kd-loss-scale", type=float, default=1.0, metavar="S",
                    help="with --no-skip-lm-loss: the distillation loss is scaled to S times the LM loss (default 1.0)")


def distill_from_args(args: argparse.Namespace, cfg: Any, callbacks: Optional[Any]) -> Any:
    """Make ``cfg.model`` the student of ``--teacher`` and run ``distill``; returns the final state."""
    # `longspan --help` must not import torch
    from longspan.training.distill import (
        ModelOptDistillConfig,
        convert_to_distillation_provider,
        distill,
        teacher_provider_from,
    )

    if not args.teacher:
        raise ConfigError("longspan distill needs --teacher DIR: an HF model directory or a longspan checkpoint")
    kd = ModelOptDistillConfig(skip_lm_loss=args.skip_lm_loss, kd_loss_scale=args.kd_loss_scale,
                               logit_kl_temperature=args.logit_kl_temperature)
    convert_to_distillation_provider(cfg.model, teacher_provider_from(args.teacher), kd,
                                     teacher_checkpoint=args.teacher)
    return distill(cfg, callbacks=callbacks)
