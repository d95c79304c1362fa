"""``ModelOptDistillConfig`` and the distillation provider (Megatron Bridge's names, without ModelOpt).

``convert_to_distillation_provider(student, teacher, kd_config)`` turns the student's model provider into a
``DistillationProvider``: the same object, still its own class for everything that builds, validates and saves
it (the saved ``run_config.yaml`` holds the student alone, as Bridge's ``to_cfg_dict`` writes it), carrying the
teacher's provider, where the teacher's weights come from and the KD settings. ``distill()``
(``longspan.training.distill.distill``) builds the teacher beside the student from them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from longspan.conversion import is_hf_model_dir
from longspan.conversion.bridge import AutoBridge
from longspan.core.errors import ConfigError, NotSupportedError
from longspan.models.gpt_provider import GPTModelProvider
from longspan.training.checkpointing.model_loading import load_checkpoint_config

#: the logit layer pair the KL loss reads (GPT's output projection, on both models)
LOGIT_LAYERS = ["output_layer", "output_layer"]


@dataclass
class ModelOptDistillConfig:
    """Knowledge-distillation settings: the fields of ModelOpt's ``DistillationConfig`` that mean something
    without ModelOpt."""

    logit_layers: list[str] = field(default_factory=lambda: list(LOGIT_LAYERS))
    """Student and teacher submodules whose outputs are the logits of the KL loss; only ``["output_layer",
    "output_layer"]`` (the output projection, read chunk by chunk without materialising the logits)."""

    intermediate_layer_pairs: list[list[str]] = field(default_factory=list)
    """Pairs of [student, teacher] submodule names (``decoder.final_layernorm``, ``decoder.layers.1``) with a cosine
    loss between their outputs per token (ModelOpt's ``HiddenStateCosineLoss``): both on the last pipeline stage,
    outputs of one size (no projection layer). Their mean is rescaled to the logits loss's magnitude."""

    skip_lm_loss: bool = True
    """Train on the distillation loss alone; False adds the student's LM loss (and ``kd_loss_scale`` applies)."""

    kd_loss_scale: float = 1.0
    """With the LM loss: the distillation loss is rescaled to this many times the LM loss's magnitude (per
    microbatch, as ModelOpt's balancer does). Not used when ``skip_lm_loss``."""

    logit_kl_temperature: float = 1.0
    """Both models' logits are divided by this before the softmaxes of the KL divergence."""

    def check(self) -> None:
        """One-line ConfigError for a value distillation cannot use."""
        if list(self.logit_layers) != LOGIT_LAYERS:
            raise NotSupportedError(
                f"kd_config.logit_layers={list(self.logit_layers)} is not supported yet: the KL loss reads the "
                f"output projections, {LOGIT_LAYERS}"
            )
        for pair in self.intermediate_layer_pairs:
            if isinstance(pair, str) or len(pair) != 2 or not all(isinstance(n, str) and n for n in pair):
                raise ConfigError(
                    f"kd_config.intermediate_layer_pairs entry {pair!r} must be a [student module, teacher module] "
                    "pair of names, e.g. ['decoder.final_layernorm', 'decoder.final_layernorm']"
                )
        if not isinstance(self.skip_lm_loss, bool):
            raise ConfigError(f"kd_config.skip_lm_loss={self.skip_lm_loss!r} must be true or false")
        temperature = self.logit_kl_temperature
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not (
                math.isfinite(temperature) and temperature > 0):
            raise ConfigError(f"kd_config.logit_kl_temperature={temperature!r} must be a number > 0")
        scale = self.kd_loss_scale
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (math.isfinite(scale) and scale >= 0):
            raise ConfigError(f"kd_config.kd_loss_scale={scale!r} must be a number >= 0")


class DistillationProvider:
    """A student model provider in distillation mode (Bridge's name); made by ``convert_to_distillation_provider``.

    Attributes (not config fields: the saved config is the student's):
        teacher: the teacher's model provider (its architecture; its layout fields become the student's).
        kd_config: the ``ModelOptDistillConfig``.
        teacher_checkpoint: where the teacher's weights come from: an HF model directory or a longspan checkpoint.
    """

    teacher: Any
    kd_config: ModelOptDistillConfig
    teacher_checkpoint: Optional[str]


_CLASSES: dict[type, type] = {}


def _distillation_class(base: type) -> type:
    """The ``DistillationProvider`` subclass of ``base``, under ``base``'s own names (the config catalog, the support
    table and the saved ``_target_`` find the student's class by its name)."""
    if base not in _CLASSES:
        _CLASSES[base] = type(base.__name__, (DistillationProvider, base),
                              {"__module__": base.__module__, "__qualname__": base.__qualname__})
    return _CLASSES[base]


def convert_to_distillation_provider(
    student_provider: Any,
    teacher_provider: Any,
    kd_config: Optional[ModelOptDistillConfig] = None,
    *,
    teacher_checkpoint: Optional[str] = None,
) -> Any:
    """Make ``student_provider`` a ``DistillationProvider`` (in place; returned) with ``teacher_provider``.

    ``teacher_checkpoint`` (longspan's addition; Bridge loads the teacher in its provider's hooks): an HF model
    directory or a longspan checkpoint holding the teacher's weights. ``teacher_provider_from(path)`` gives the
    teacher provider of such a path.
    """
    for name, provider in (("student", student_provider), ("teacher", teacher_provider)):
        if not isinstance(provider, GPTModelProvider):
            raise NotSupportedError(
                f"distillation of a {type(provider).__name__} {name} is not supported yet: the student and the "
                "teacher must be GPT model providers"
            )
    kd_config = kd_config if kd_config is not None else ModelOptDistillConfig()
    kd_config.check()
    base = type(student_provider)
    if isinstance(student_provider, DistillationProvider):
        base = base.__mro__[2]  # converting again: the student's own class, behind the mixin
    student_provider.__class__ = _distillation_class(base)
    student_provider.teacher = teacher_provider
    student_provider.kd_config = kd_config
    student_provider.teacher_checkpoint = str(teacher_checkpoint) if teacher_checkpoint is not None else None
    return student_provider


def teacher_provider_from(path: str) -> Any:
    """The model provider of a teacher's weights: an HF model directory's (its config.json) or a longspan
    checkpoint's (its run_config.yaml)."""
    directory = Path(path)
    if not directory.exists():
        raise ConfigError(f"teacher checkpoint {path} does not exist: give an HF model directory or a longspan "
                          "checkpoint")
    if is_hf_model_dir(directory):
        return AutoBridge.from_hf_pretrained(directory).to_megatron_provider(load_weights=False)
    return load_checkpoint_config(directory).cfg.model
