"""Intermediate-layer losses of distillation (``kd_config.intermediate_layer_pairs``): ModelOpt's
``HiddenStateCosineLoss``, ``1 - cos(student output, teacher output)`` per token, between named submodules of the
two models' last pipeline stages (Megatron Bridge computes them there too). The outputs must have one size: the
trainable projection ModelOpt puts between different sizes is not supported yet.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from longspan.core.errors import ConfigError, NotSupportedError
from longspan.training.distill.kd_loss import replicated_hidden


class IntermediatePairs:
    """Forward hooks keeping the paired submodules' outputs of the current microbatch, and their cosine loss."""

    def __init__(self, student: nn.Module, teacher: nn.Module, pairs: list[list[str]], pipelined: bool) -> None:
        self.pairs = [list(pair) for pair in pairs]
        self.student_out: dict[int, torch.Tensor] = {}
        self.teacher_out: dict[int, torch.Tensor] = {}
        for index, (student_name, teacher_name) in enumerate(self.pairs):
            _submodule(student, student_name, "student", index, pipelined).register_forward_hook(
                partial(_keep, self.student_out, index, False))
            _submodule(teacher, teacher_name, "teacher", index, pipelined).register_forward_hook(
                partial(_keep, self.teacher_out, index, True))

    def per_token_loss(self) -> torch.Tensor:
        """The mean over the pairs of ``1 - cos`` per token, ``[b, s]`` (this rank's tokens)."""
        losses = []
        for index, (student_name, teacher_name) in enumerate(self.pairs):
            student = replicated_hidden(self.student_out.pop(index))
            teacher = replicated_hidden(self.teacher_out.pop(index))
            if student.shape != teacher.shape:
                raise NotSupportedError(
                    f"kd_config.intermediate_layer_pairs[{index}]: the student's {student_name} gives "
                    f"{list(student.shape)}, the teacher's {teacher_name} {list(teacher.shape)}; a projection between "
                    "different sizes is not supported yet: pair outputs of one size"
                )
            losses.append(1.0 - F.cosine_similarity(student.float(), teacher.float(), dim=-1))
        return torch.stack(losses).mean(0)


def _submodule(model: nn.Module, name: str, role: str, index: int, pipelined: bool) -> nn.Module:
    try:
        return model.get_submodule(name)
    except AttributeError:
        where = " on its last pipeline stage (the intermediate losses are computed there)" if pipelined else ""
        raise ConfigError(
            f"kd_config.intermediate_layer_pairs[{index}]: the {role} has no module {name!r}{where}"
        ) from None


def _keep(store: dict[int, torch.Tensor], index: int, detach: bool, module: nn.Module, args: Any,
          output: Any) -> None:
    tensor = output[0] if isinstance(output, (tuple, list)) else output
    store[index] = tensor.detach() if detach else tensor
