"""Training utilities of Bridge's train_utils: value heads, MoE router freezing, norms and reductions across parallel
groups, the training log, memory/throughput/runtime reports, and GlobalState injection into forward steps.

The parallel-group helpers take process groups (or None) and are no-ops on one process. Norms live in
``utils/norms.py``, memory helpers in ``observability/memory.py``, FLOPs in ``longspan/planner/flops.py``, the
log line and metric writing in ``observability/log_line.py``, the validation block in
``observability/validation_log.py``; every seed-003 name is importable from here.
"""

from __future__ import annotations

import inspect
from functools import partial
from typing import Any, Callable, Optional, Union

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from longspan.core.logging import get_logger
from longspan.training.observability.loggers import sanitize_mlflow_metrics
from longspan.training.state import GlobalState
from longspan.training.utils.comm import (
    logical_and_across_model_parallel_group,
    reduce_max_stat_across_model_parallel_group,
)
from longspan.planner.flops import num_floating_point_operations
from longspan.training.observability.log_line import training_log
from longspan.training.observability.memory import (
    MEMORY_KEYS,
    reduce_max_memory_across_pp_group,
    report_memory,
    start_memory_history_recording,
)
from longspan.training.utils.norms import (
    calc_dtensor_params_l2_norm,
    calc_params_l2_norm,
    param_is_not_shared,
    report_l2_norm_grad,
)
from longspan.training.observability.progress_log import append_to_progress_log
from longspan.training.observability.reports import report_runtime, report_throughput
from longspan.training.observability.validation_log import log_validation_results

logger = get_logger(__name__)

ModelList = list[nn.Module]
ModelHook = Callable[[Union[ModelList, nn.Module]], Optional[ModelList]]

__all__ = [
    "LinearForLastLayer",
    "MEMORY_KEYS",
    "ModelHook",
    "ModelList",
    "_MoeMetricFanoutWriter",
    "_build_moe_metric_writer",
    "_ensure_model_list",
    "_freeze_parameter_if_present",
    "_register_linear_for_last_layer_mapping",
    "append_to_progress_log",
    "calc_dtensor_params_l2_norm",
    "calc_params_l2_norm",
    "create_value_head_hook",
    "freeze_moe_router",
    "log_validation_results",
    "logical_and_across_model_parallel_group",
    "make_value_model",
    "maybe_inject_state",
    "needs_global_state_injection",
    "num_floating_point_operations",
    "param_is_not_shared",
    "prepare_forward_step_func",
    "reduce_max_memory_across_pp_group",
    "reduce_max_stat_across_model_parallel_group",
    "report_l2_norm_grad",
    "report_memory",
    "report_runtime",
    "report_throughput",
    "start_memory_history_recording",
    "training_log",
]


# ---------------------------------------------------------------------------------------------- value heads


def _register_linear_for_last_layer_mapping() -> None:
    """Megatron Bridge's hook registering ``LinearForLastLayer`` with its HF weight-conversion mappings as a
    replicated parameter. longspan's conversion tables have no value-head entry, so there is nothing to
    register; kept under Bridge's name for scripts that call it."""


class LinearForLastLayer(nn.Linear):
    """Final replicated projection head compatible with Megatron output-layer calls.

    Megatron output layers are called as ``layer(hidden, weight=..., runtime_gather_output=...)`` and return
    ``(output, bias)``; this head accepts and ignores those runtime arguments and applies a plain replicated
    ``hidden -> output_size`` projection without bias.
    """

    def __init__(self, input_size: int, output_size: int, sequence_parallel: bool) -> None:
        """Initialize a replicated final projection.

        Args:
            input_size: hidden dimension of the transformer output.
            output_size: output dimension of the value/reward head.
            sequence_parallel: whether activations arrive sharded along the sequence; a DTensor input is then
                gathered to the full sequence before the projection.
        """
        super().__init__(in_features=input_size, out_features=output_size, bias=False)
        self.sequence_parallel = sequence_parallel
        if sequence_parallel:
            self.weight.sequence_parallel = True

    def forward(
        self,
        input_: torch.Tensor,
        weight: torch.Tensor | None = None,
        runtime_gather_output: bool | None = None,
    ) -> tuple[torch.Tensor, None]:
        """Run the final projection and return Megatron-style ``(output, bias)`` with output in float32."""
        del weight, runtime_gather_output
        if isinstance(input_, DTensor):
            input_ = input_.full_tensor()
        return super().forward(input_).float(), None


def _is_last_stage(chunk: nn.Module, index: int, num_chunks: int) -> bool:
    """Whether ``chunk`` computes the model output: its ``post_process`` flag, else the last chunk."""
    post_process = getattr(chunk, "post_process", None)
    if post_process is not None:
        return bool(post_process)
    return index == num_chunks - 1


def create_value_head_hook(hidden_size: int, sequence_parallel: bool, output_size: int = 1) -> ModelHook:
    """Create a pre-wrap hook that replaces the final pipeline stage output head.

    The hook sets ``output_layer = LinearForLastLayer(hidden_size, output_size, sequence_parallel)`` on each
    chunk that produces the output (``chunk.post_process`` when the chunk has it, else the last chunk).

    Args:
        hidden_size: hidden dimension of the transformer output.
        sequence_parallel: whether the model uses sequence parallelism.
        output_size: number of outputs produced by the final head.

    Returns:
        A model hook ``hook(model) -> list of chunks`` for provider construction.
    """
    _register_linear_for_last_layer_mapping()

    def hook(model: Union[ModelList, nn.Module]) -> ModelList:
        chunks = _ensure_model_list(model)
        for index, chunk in enumerate(chunks):
            if _is_last_stage(chunk, index, len(chunks)):
                chunk.output_layer = LinearForLastLayer(
                    input_size=hidden_size, output_size=output_size, sequence_parallel=sequence_parallel
                )
        return chunks

    return hook


def make_value_model(hidden_size: int, sequence_parallel: bool) -> ModelHook:
    """Create a value-head hook (one output) compatible with existing external trainer code."""
    return create_value_head_hook(hidden_size=hidden_size, sequence_parallel=sequence_parallel)


# ---------------------------------------------------------------------------------------------- MoE routers
def _ensure_model_list(model: Union[ModelList, nn.Module]) -> ModelList:
    """``model`` itself when it is a list of chunks, else ``[model]``."""
    return model if isinstance(model, list) else [model]


def _freeze_parameter_if_present(module: object, name: str) -> None:
    """Set ``requires_grad=False`` on ``module.<name>`` when that attribute exists and is not None."""
    parameter = getattr(module, name, None)
    if parameter is not None:
        parameter.requires_grad = False


def freeze_moe_router(model: Union[ModelList, nn.Module]) -> ModelList:
    """Freeze MoE router and shared-expert gate parameters in model chunks.

    Frozen: every parameter of a submodule named ``router``; a shared-expert gate, i.e. the parameters of
    ``shared_experts.gate`` (or ``shared_expert_gate``) and the attributes ``shared_experts.gate_weight`` /
    ``gate_bias`` (Megatron's naming). Expert weights and everything else keep their ``requires_grad``.

    Args:
        model: single module or list of virtual-pipeline model chunks.

    Returns:
        The normalized model chunk list with router parameters frozen in place.
    """
    chunks = _ensure_model_list(model)
    for chunk in chunks:
        for name, module in chunk.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if leaf in ("router", "shared_expert_gate"):
                for param in module.parameters():
                    param.requires_grad = False
            elif leaf == "shared_experts":
                _freeze_parameter_if_present(module, "gate_weight")
                _freeze_parameter_if_present(module, "gate_bias")
                gate = getattr(module, "gate", None)
                if isinstance(gate, nn.Module):
                    for param in gate.parameters():
                        param.requires_grad = False
    return chunks


# ---------------------------------------------------------------------------------------------- MoE metric writer
class _MoeMetricFanoutWriter:
    """SummaryWriter-shaped adapter that fans ``add_scalar`` out to TensorBoard, MLflow and Comet.

    MoE / MTP metric helpers only know a TensorBoard-style ``writer.add_scalar(name, value, iteration)``; this
    adapter forwards every call to the real writer (if any) and to MLflow and Comet, converting 0-d tensors
    to Python scalars for the latter two (which reject tensors).
    """

    def __init__(self, tb_writer: Optional[Any], comet_logger: Optional[Any], mlflow_logger: Optional[Any]) -> None:
        self._tb_writer = tb_writer
        self._comet_logger = comet_logger
        self._mlflow_logger = mlflow_logger

    @staticmethod
    def _sanitize(value: Any) -> Any:
        """Convert 0-d torch tensors to Python scalars; pass other values through."""
        if isinstance(value, torch.Tensor):
            try:
                return value.item()
            except (RuntimeError, ValueError):
                return value
        return value

    def add_scalar(self, name: str, value: Any, iteration: int) -> None:
        """Forward an add_scalar call to TensorBoard (if any), MLflow, and Comet."""
        if self._tb_writer is not None:
            self._tb_writer.add_scalar(name, value, iteration)
        if self._mlflow_logger is None and self._comet_logger is None:
            return
        metrics = {name: self._sanitize(value)}
        if self._mlflow_logger is not None:
            self._mlflow_logger.log_metrics(sanitize_mlflow_metrics(metrics), step=iteration)
        if self._comet_logger is not None:
            self._comet_logger.log_metrics(metrics, step=iteration)


def _build_moe_metric_writer(
    tb_writer: Optional[Any], comet_logger: Optional[Any], mlflow_logger: Optional[Any]
) -> Optional[Any]:
    """The writer for MoE/MTP metric helpers: ``tb_writer`` itself when neither MLflow nor Comet is set,
    else a ``_MoeMetricFanoutWriter`` (even when ``tb_writer`` is None, so those backends still get them)."""
    if comet_logger is None and mlflow_logger is None:
        return tb_writer
    return _MoeMetricFanoutWriter(tb_writer, comet_logger, mlflow_logger)


# ---------------------------------------------------------------------------------------------- state injection
def _is_global_state_annotation(annotation: Any) -> bool:
    if annotation is inspect.Parameter.empty:
        return False
    if annotation is GlobalState:
        return True
    if isinstance(annotation, str):
        return "GlobalState" in annotation
    return getattr(annotation, "__name__", None) == "GlobalState"


def needs_global_state_injection(forward_step_func: Callable) -> bool:
    """Whether ``forward_step_func`` expects the GlobalState as its first argument.

    True when any parameter is annotated ``GlobalState`` (the class, a string annotation naming it, or a
    class of that name), else when the first parameter is named ``state`` or ``global_state``. Works for
    functions, callable objects (their ``__call__``) and ``functools.partial`` (bound arguments excluded).
    """
    try:
        parameters = inspect.signature(forward_step_func).parameters
    except (TypeError, ValueError):
        return False
    if any(_is_global_state_annotation(p.annotation) for p in parameters.values()):
        return True
    names = list(parameters)
    return bool(names) and names[0] in ("state", "global_state")


def maybe_inject_state(
    forward_step_func: Callable, state: GlobalState, needs_injection: Optional[bool] = None
) -> Callable:
    """``functools.partial(forward_step_func, state)`` when it expects the state, else the function itself.

    Supported signatures: ``(data_iterator, model)`` and ``(data_iterator, model, return_schedule_plan)`` (no
    injection); ``(state: GlobalState, data_iterator, model[, return_schedule_plan])`` and
    ``(state, data_iterator, model)`` (injection). Pass ``needs_injection`` to skip the signature inspection.
    """
    if needs_injection is None:
        needs_injection = needs_global_state_injection(forward_step_func)
    return partial(forward_step_func, state) if needs_injection else forward_step_func


def prepare_forward_step_func(forward_step_func: Callable, state: GlobalState) -> Callable:
    """Inspect once and inject the state if needed; call at the start of ``train()``/``evaluate()``.

    Wrapping once is safe: the partial holds a reference to the mutable state, so later changes (e.g.
    ``state.train_state.step``) are visible; a functor keeps its own attributes (the partial wraps the
    instance).
    """
    return maybe_inject_state(forward_step_func, state, needs_injection=needs_global_state_injection(forward_step_func))
