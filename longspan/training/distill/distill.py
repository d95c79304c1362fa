"""``distill(config, forward_step_func=None, callbacks=None)``: Megatron Bridge's knowledge-distillation entry point.

The student trains as ``pretrain`` trains it (its checkpoints, optimizer, logs); ``config.model`` is a
``DistillationProvider`` (``convert_to_distillation_provider``) naming the teacher. After setup the teacher is
built with the student's layout, loaded and frozen (``teacher.build_teacher``), and the forward step becomes
``DistillationForwardStep``: each microbatch runs through the teacher (no-grad) and then the student, whose
last stage returns, per token, ``[LM loss, KL(teacher || student)]``; the KL comes from the two final hidden
states and output projections chunk by chunk (``kd_loss.linear_kl_divergence``, vocab-parallel under tensor
parallel), so neither model's logits exist whole.

The loss (``distillation_loss``) is ModelOpt's ``LogitsAndIntermediatesLossBalancer``: the masked KL sum of the
microbatch, plus the intermediate layers' cosine loss (``intermediate.py``) rescaled to the KL's magnitude; with
``skip_lm_loss=False`` the LM loss plus that sum rescaled to ``kd_loss_scale`` times the LM loss's magnitude (the
rescaling factors are constants, as ModelOpt's ``.item()``). Reported per iteration (metrics.jsonl, the log
line): ``lm loss``, ``logits distillation loss``, ``intermediate distillation loss`` (with layer pairs) and
``total loss`` (Bridge's names). Evaluation reports the same and is judged on the LM loss, as in Bridge.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Iterator, Optional, Union

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from longspan.core.errors import ConfigError
from longspan.models.gpt_provider import GPTModelProvider
from longspan.parallel.pipeline import chunk_info, unwrap_chunk
from longspan.training.callbacks import Callback, CallbackManager
from longspan.training.distill.config import DistillationProvider, ModelOptDistillConfig
from longspan.training.distill.intermediate import IntermediatePairs
from longspan.training.distill.kd_loss import group_reductions, linear_kl_divergence, replicated_hidden, vocab_shard
from longspan.training.distill.teacher import Teacher, build_teacher, check_teacher_fits
from longspan.training.pretrain import run_training
from longspan.training.state import GlobalState
from longspan.training.step.forward_step import forward_step as default_forward_step
from longspan.training.utils.train_utils import maybe_inject_state

REPORT_LOGITS = "logits distillation loss"
REPORT_TOTAL = "total loss"
REPORT_INTERMEDIATE = "intermediate distillation loss"


def distill(
    config: Any,
    forward_step_func: Optional[Callable] = None,
    callbacks: Union[list[Callback], CallbackManager, None] = None,
) -> GlobalState:
    """Distill ``config.model``'s teacher into the student; returns the final GlobalState (its ``distill_teacher``
    holds the teacher this rank ran).

    ``forward_step_func`` (default: the GPT forward step) reads the batch and calls the model; its loss function
    must take per-token losses (Megatron's ``(loss_sum, num_tokens, report)`` form).
    """
    model = config.model
    if not isinstance(model, DistillationProvider):
        raise ConfigError(
            f"distill() needs config.model to be a DistillationProvider, not {type(model).__name__}: "
            "convert_to_distillation_provider(student, teacher, kd_config, teacher_checkpoint=DIR)"
        )
    if not isinstance(model, GPTModelProvider):
        raise ConfigError(f"distillation of a {type(model).__name__} student is not supported yet")
    model.kd_config.check()
    check_teacher_fits(model, model.teacher)  # what can be told before setup: fail before any work
    return run_training(config, forward_step_func or default_forward_step, callbacks, after_setup=_attach_teacher)


def _attach_teacher(out: Any, forward_step_func: Callable) -> Callable:
    """After setup: build the teacher, hook the student's loss, and return the distillation forward step."""
    state = out.state
    teacher = build_teacher(state.cfg, state.parallel)
    state.distill_teacher = teacher
    kd = state.cfg.model.kd_config
    for chunk in out.model:
        info = chunk_info(chunk)
        if info is None or info.is_last:
            student = unwrap_chunk(chunk)
            pairs = None
            if kd.intermediate_layer_pairs:
                pairs = IntermediatePairs(student, unwrap_chunk(teacher.chunks[0]), kd.intermediate_layer_pairs,
                                          pipelined=info is not None)
            _hook_student_loss(student, teacher, float(kd.logit_kl_temperature), pairs)
    return DistillationForwardStep(forward_step_func, teacher, kd)


def _hook_student_loss(model: nn.Module, teacher: Teacher, temperature: float,
                       pairs: Optional[IntermediatePairs]) -> None:
    """The student's last stage returns ``[..., 2]``: its LM loss and the KL to the teacher, per token (``[..., 3]``
    with the intermediate layers' cosine loss)."""
    lm_loss = model._output_loss  # the class's loss path (plain, fused or vocab-parallel), bound to the model

    def lm_and_kl(hidden_states: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        lm = lm_loss(hidden_states, labels)
        if isinstance(lm, DTensor):  # the plain loss path under tensor parallel: replicated over the tp ranks
            lm = lm.to_local() if all(p.is_replicate() for p in lm.placements) else lm.full_tensor()
        if not teacher.captured:
            raise RuntimeError("distillation: the student's loss ran without the teacher's forward before it")
        hidden_t = teacher.captured.pop()
        weight, _, group = vocab_shard(model.output_weight())
        reduce_max, reduce_sum = group_reductions(group)
        kl = linear_kl_divergence(replicated_hidden(hidden_states), weight, hidden_t, teacher.output_weight,
                                  temperature, reduce_max=reduce_max, reduce_sum=reduce_sum)
        columns = [lm, kl.view(lm.shape).to(lm.dtype)]
        if pairs is not None:
            columns.append(pairs.per_token_loss().view(lm.shape).to(lm.dtype))
        return torch.stack(columns, dim=-1)

    model._output_loss = lm_and_kl


class _TeacherThenStudent:
    """The model a forward step sees: a call runs the teacher's chunk on the same inputs (no-grad), then the student.

    On a pipeline stage after the first the teacher's input is the previous stage's teacher hidden states; a
    stage before the last passes its teacher output on. Attributes come from the student's model."""

    def __init__(self, model: Any, teacher: Teacher) -> None:
        self._model = model
        self._teacher = teacher

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        teacher = self._teacher
        info = chunk_info(self._model)
        teacher_args, teacher_kwargs = args, kwargs
        if info is not None and not info.is_first:  # the teacher's own hidden states replace the token ids
            hidden = teacher.relay.recv()
            if args:
                teacher_args = (hidden, *args[1:])
            else:
                teacher_kwargs = {k: v for k, v in kwargs.items() if k != "input_ids"}
                teacher_kwargs["hidden_states"] = hidden
        with torch.no_grad():
            out = teacher.chunks[0](*teacher_args, **teacher_kwargs)
        if info is not None and not info.is_last:
            teacher.relay.send(out)
        return self._model(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


class DistillationForwardStep:
    """A forward step whose model call runs the teacher, then the student, and whose loss is the distillation loss."""

    def __init__(self, forward_step_func: Callable, teacher: Teacher, kd_config: ModelOptDistillConfig) -> None:
        self.forward_step_func = forward_step_func
        self.teacher = teacher
        self.kd_config = kd_config

    def __call__(self, state: GlobalState, data_iterator: Iterator, model: Any) -> tuple[torch.Tensor, Callable]:
        step = maybe_inject_state(self.forward_step_func, state)
        output, loss_func = step(data_iterator, _TeacherThenStudent(model, self.teacher))
        training = bool(getattr(unwrap_chunk(model) if isinstance(model, nn.Module) else model, "training", True))
        return output, partial(distillation_loss, loss_func, self.kd_config, training)


def distillation_loss(loss_func: Callable, kd_config: ModelOptDistillConfig, training: bool,
                      output_tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The microbatch's loss from the per-token ``[LM loss, KL]`` pairs, masked by ``loss_func`` (see module doc)."""
    outputs = loss_func(output_tensor[..., 0])
    if len(outputs) != 3:
        raise TypeError("distillation needs a loss function of Megatron's per-token form: (loss_sum, num_tokens, "
                        "report)")
    lm_sum, num_tokens, report = outputs
    kl_sum = loss_func(output_tensor[..., 1])[0]
    count = num_tokens.detach().view(1).to(torch.float32)
    report = dict(report)
    report[REPORT_LOGITS] = torch.cat([kl_sum.detach().float().view(1), count])
    kd_sum = kl_sum
    if output_tensor.shape[-1] > 2:  # intermediate layers: their loss rescaled to the logits loss's magnitude
        inter_sum = loss_func(output_tensor[..., 2])[0]
        report[REPORT_INTERMEDIATE] = torch.cat([inter_sum.detach().float().view(1), count])
        kd_sum = kl_sum + inter_sum * _ratio(kl_sum, inter_sum)
    if kd_config.skip_lm_loss:
        total = kd_sum
    else:  # ModelOpt's balance: the distillation loss rescaled to kd_loss_scale times the LM loss
        total = lm_sum + kd_sum * (_ratio(lm_sum, kd_sum) * float(kd_config.kd_loss_scale))
    report[REPORT_TOTAL] = torch.cat([total.detach().float().view(1), count])
    return (total if training else lm_sum), num_tokens, report


def _ratio(numerator: torch.Tensor, denominator: torch.Tensor) -> float:
    """``numerator / denominator`` as a constant (no gradient through it, as ModelOpt's ``.item()``); 0 for 0."""
    value = float(denominator.detach())
    return float(numerator.detach()) / value if value > 0.0 else 0.0
