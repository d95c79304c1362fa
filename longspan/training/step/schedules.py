"""Forward/backward over the microbatches of one global batch (no pipeline parallelism).

Megatron's loss reduction: with the per-token loss form (``loss_func`` returns three values) each
microbatch's loss is its masked mean divided by the number of microbatches, so gradients average over
microbatches (and, through data parallelism, over ranks); with ``calculate_per_token_loss`` the summed loss
is backpropagated and the gradients are divided by the global token count afterwards (see
``finalize_model_grads``), which makes the loss Σ(loss·mask)/Σmask over the whole global batch.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from longspan.parallel.loss_parallel import parallel_loss_context
from longspan.training.step.loss_checks import TrainingDivergedError  # noqa: F401 - re-exported (its old home)
from longspan.training.step.loss_checks import check_finite, set_moe_aux_loss_scale
from longspan.training.step.pipeline_schedules import forward_backward_pipelining


def no_sync_context(model: torch.nn.Module) -> contextlib.AbstractContextManager:
    """Suppress data-parallel gradient reduction for all but the last microbatch.

    DDP exposes ``no_sync()``; FSDP2 modules use ``set_requires_gradient_sync`` (handled by the parallel
    layer through a ``no_sync`` attribute it installs); plain modules need nothing.
    """
    no_sync = getattr(model, "no_sync", None)
    return no_sync() if callable(no_sync) else contextlib.nullcontext()


def get_forward_backward_func(pipeline_model_parallel_size: int) -> Callable:
    """Megatron's chooser: the pipelined schedules when there is more than one pipeline stage."""
    if pipeline_model_parallel_size > 1:
        return forward_backward_pipelining
    return forward_backward_no_pipelining


def run_forward_backward(
    global_state: Any,
    forward_step_func: Callable,
    data_iterator: Iterator,
    model: Any,
    num_microbatches: int,
    *,
    forward_only: bool,
    grad_scale_func: Callable[[torch.Tensor], torch.Tensor] | None = None,
    check_for_nan: bool = False,
    iteration: int | None = None,
) -> tuple[list[dict[str, Any]], torch.Tensor | None]:
    """The run's forward-backward schedule (pipelined or not) with the settings training and evaluation share:
    per-token loss, autocast dtype and device from the run's config and state."""
    forward_backward = get_forward_backward_func(global_state.parallel.pp_size)
    return forward_backward(
        forward_step_func=forward_step_func,
        data_iterator=data_iterator,
        model=model,
        num_microbatches=num_microbatches,
        forward_only=forward_only,
        calculate_per_token_loss=global_state.cfg.model.calculate_per_token_loss,
        grad_scale_func=grad_scale_func,
        autocast_dtype=global_state.autocast_dtype,
        device_type=global_state.device.type,
        check_for_nan=check_for_nan,
        iteration=iteration,
    )


def forward_backward_no_pipelining(
    *,
    forward_step_func: Callable,
    data_iterator: Iterator,
    model: list[torch.nn.Module],
    num_microbatches: int,
    forward_only: bool = False,
    calculate_per_token_loss: bool = False,
    grad_scale_func: Callable[[torch.Tensor], torch.Tensor] | None = None,
    autocast_dtype: torch.dtype | None = None,
    device_type: str = "cpu",
    check_for_nan: bool = True,
    iteration: int | None = None,
) -> tuple[list[dict[str, Any]], torch.Tensor]:
    """Run ``num_microbatches`` forward (and backward) passes; return per-microbatch reports and Σtokens."""
    if len(model) != 1:
        raise NotImplementedError("several model chunks need the pipeline schedules")
    chunk = model[0]
    reports: list[dict[str, Any]] = []
    total_tokens = torch.zeros((), dtype=torch.int64)
    autocast = (
        torch.autocast(device_type=device_type, dtype=autocast_dtype)
        if autocast_dtype is not None
        else contextlib.nullcontext()
    )

    def one_microbatch() -> torch.Tensor:
        nonlocal total_tokens
        with autocast:
            output_tensor, loss_func = forward_step_func(data_iterator, chunk)
        outputs = loss_func(output_tensor)
        if len(outputs) == 3:
            loss, num_tokens, report = outputs
            total_tokens = total_tokens + num_tokens.detach().to(torch.int64).cpu()
            if not calculate_per_token_loss:
                loss = loss / num_tokens.clamp(min=1)
                loss = loss / num_microbatches
        elif len(outputs) == 2:
            loss, report = outputs
            loss = loss / num_microbatches
        else:
            raise TypeError("loss_func must return (loss, num_tokens, report) or (loss, report)")
        if check_for_nan:
            check_finite(loss.detach(), "the loss", iteration)
        reports.append(report)
        return loss

    set_moe_aux_loss_scale(grad_scale_func, num_microbatches, calculate_per_token_loss)

    if forward_only:
        with torch.no_grad(), parallel_loss_context(chunk):
            for _ in range(num_microbatches):
                one_microbatch()
        return reports, total_tokens

    for index in range(num_microbatches):
        last = index == num_microbatches - 1
        # The vocab-parallel loss context must cover the backward too (tensor parallel keeps logits sharded).
        with (contextlib.nullcontext() if last else no_sync_context(chunk)), parallel_loss_context(chunk):
            loss = one_microbatch()
            if grad_scale_func is not None:
                loss = grad_scale_func(loss)
            loss.backward()
    return reports, total_tokens


def finalize_model_grads(
    model: list[torch.nn.Module],
    num_tokens: torch.Tensor | None,
    *,
    dp_group: Any = None,
    dp_size: int = 1,
) -> None:
    """Scale gradients by 1/Σtokens over the data-parallel group when ``calculate_per_token_loss``.

    Data-parallel wrappers average gradients over ranks (divide by dp); per-token loss wants a sum over
    ranks divided by the global token count, hence the factor dp / Σtokens.
    """
    if num_tokens is None:
        return
    total = num_tokens.clone().to(torch.float64)
    if dp_size > 1:
        dist.all_reduce(total, group=dp_group)
    scale = float(dp_size) / max(float(total.item()), 1.0)
    for chunk in model:
        for param in chunk.parameters():
            if param.grad is not None:
                param.grad.mul_(scale)


def reduce_loss_reports(reports: list[dict[str, Any]], dp_group: Any = None) -> dict[str, torch.Tensor]:
    """Σ/Σ of [sum, count] reports (or the mean of plain values) over microbatches and data-parallel ranks."""
    reduced: dict[str, torch.Tensor] = {}
    if not reports:
        return reduced
    for key in reports[0]:
        values = [torch.as_tensor(r[key], dtype=torch.float64).detach().cpu().view(-1) for r in reports]
        if values[0].numel() == 2:
            total = torch.vstack(values).sum(dim=0)
            if dp_group is not None:
                dist.all_reduce(total, group=dp_group)
            reduced[key] = (total[0] / total[1].clamp(min=1)).to(torch.float32)
        else:
            total = torch.stack([v.mean() for v in values]).mean()
            if dp_group is not None:
                total = total / dist.get_world_size(dp_group)
                dist.all_reduce(total, group=dp_group)
            reduced[key] = total.to(torch.float32)
    return reduced
