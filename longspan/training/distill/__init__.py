"""Knowledge distillation (Megatron Bridge's ``distill()``): a frozen teacher beside the student, KL on the logits."""

from longspan.training.distill.config import (
    DistillationProvider,
    ModelOptDistillConfig,
    convert_to_distillation_provider,
    teacher_provider_from,
)
from longspan.training.distill.distill import distill

__all__ = [
    "DistillationProvider",
    "ModelOptDistillConfig",
    "convert_to_distillation_provider",
    "distill",
    "teacher_provider_from",
]
