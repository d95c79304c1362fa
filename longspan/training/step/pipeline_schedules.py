"""Forward/backward over the microbatches of one global batch with pipeline parallelism.

Built on ``torch.distributed.pipelining``: every model chunk of this rank (``longspan.parallel.pipeline``)
becomes a ``PipelineStage`` and one schedule runs them: ``model.pipeline_parallel_schedule`` (the chunks carry
it), by default ``Schedule1F1B`` for one chunk per rank and ``ScheduleInterleaved1F1B`` for several (virtual
pipeline); ``ScheduleGPipe`` and the zero-bubble schedules (``ScheduleInterleavedZeroBubble``, and the V-shaped
``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV``) on request (``longspan.core.pipeline_schedules``). The
zero-bubble ones split each backward into its input and weight gradients on the stage's autograd graph
(torch's ``stage_backward_input`` / ``stage_backward_weight``); the forward step's stage needs nothing more.

Megatron's contract is kept: on *every* stage the forward step ``forward_step(data_iterator, model)`` is
called once per microbatch and reads that microbatch itself (every rank of a data-parallel group builds the
same iterator; the microbatches of a step are read once and replayed to each local chunk). On a stage
after the first, ``model`` receives the previous stage's hidden states in place of the token ids; on the
last stage the forward step's ``loss_func`` runs right after the forward, with the loss scaling of
``forward_backward_no_pipelining`` (masked mean / num_microbatches, or the summed loss with
``calculate_per_token_loss``), and the scaled loss is the stage's output that torch's schedule
backpropagates (its own ``loss_fn`` is the identity and its gradient scaling is off).

The per-microbatch loss reports and the token count live on the last stage; they are broadcast over the
pipeline group, so the caller sees on every rank what ``forward_backward_no_pipelining`` returns. A non-finite
loss is detected on the last stage and raised on every rank after the schedule (never mid-schedule, where
the other stages would wait forever).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import pipelining
from torch.distributed.pipelining import PipelineStage
from torch.nn.parallel import DistributedDataParallel

from longspan.core.errors import ConfigError
from longspan.core.pipeline_schedules import SCHEDULES as SCHEDULE_TABLE
from longspan.core.pipeline_schedules import PipelineSchedule, resolve_schedule, stage_rank
from longspan.parallel.init import get_parallel_state
from longspan.parallel.loss_parallel import parallel_loss_context
from longspan.parallel.pipeline import PipelineChunkInfo, chunk_info, sync_tied_embedding_grads, unwrap_chunk
from longspan.training.step.loss_checks import check_finite, set_moe_aux_loss_scale

#: the lower-case names ``forward_backward_pipelining`` also accepts for three of ``SCHEDULE_TABLE``'s
_ALIASES = {"1f1b": "1F1B", "interleaved_1f1b": "Interleaved1F1B", "gpipe": "GPipe"}

#: schedule names ``forward_backward_pipelining`` accepts (``"auto"``: the chunks' ``model.pipeline_parallel_schedule``)
SCHEDULES = ("auto", *_ALIASES, *SCHEDULE_TABLE)

_CACHE_ATTR = "_longspan_pipeline_runtimes"


class _StepContext:
    """What one call of ``forward_backward_pipelining`` gives the stages (and collects from the last one)."""

    def __init__(
        self,
        forward_step_func: Callable,
        num_microbatches: int,
        calculate_per_token_loss: bool,
        grad_scale_func: Callable[[torch.Tensor], torch.Tensor] | None,
        autocast_dtype: torch.dtype | None,
        device_type: str,
        forward_only: bool,
    ) -> None:
        self.forward_step_func = forward_step_func
        self.num_microbatches = num_microbatches
        self.calculate_per_token_loss = calculate_per_token_loss
        self.grad_scale_func = None if forward_only else grad_scale_func
        self.autocast_dtype = autocast_dtype
        self.device_type = device_type
        self.reports: list[dict[str, Any]] = []
        self.total_tokens = torch.zeros((), dtype=torch.int64)
        self.finite = True
        self.iterators: dict[int, Iterator] = {}
        # (N, window): num_microbatches_with_partial_activation_checkpoints and this rank's window of in-flight
        # microbatches; None when the setting is off or nothing is recomputed
        self.partial_checkpoints: tuple[int, int] | None = None
        self.forward_calls = 0

    def next_forward_recomputes_all_layers(self) -> bool:
        """megatron-core's rule for the rank's k-th forward (counted over its chunks in schedule order): every
        layer is recomputed when ``k % window >= N``, with window = the rank's warmup forwards + 1."""
        k = self.forward_calls
        self.forward_calls += 1
        if self.partial_checkpoints is None:
            return False
        n, window = self.partial_checkpoints
        return k % window >= n

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.autocast_dtype)


class _StageInputModel:
    """The model a forward step sees on a stage after the first: its first input is replaced by the hidden
    states received from the previous stage (token ids are meaningless there). Attributes come from the chunk."""

    def __init__(self, module: nn.Module, hidden_states: torch.Tensor) -> None:
        self._module = module
        self._hidden_states = hidden_states

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        token_ids = args[0] if args else kwargs.get("input_ids")
        if args:
            args = (self._hidden_states, *args[1:])
        else:
            kwargs.pop("input_ids", None)
            kwargs["hidden_states"] = self._hidden_states
        if getattr(unwrap_chunk(self._module), "mtp", None) is not None and token_ids is not None:
            kwargs["token_ids"] = token_ids  # multi-token prediction on this stage embeds shifted token ids
        return self._module(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


class _ForwardStepStage(PipelineStage):
    """A ``PipelineStage`` whose forward is the user's forward step on this chunk (see the module docstring)."""

    def __init__(self, chunk: nn.Module, info: PipelineChunkInfo, device: torch.device, group: Any,
                 split_backward: bool = False) -> None:
        act = torch.empty(info.activation_shape, dtype=info.activation_dtype, device="meta", requires_grad=True)
        index = torch.zeros(1, dtype=torch.long, device="meta")
        loss = torch.empty((), dtype=torch.float32, device="meta", requires_grad=True)
        super().__init__(
            chunk,
            info.stage_index,
            info.num_stages,
            device,
            input_args=(index,) if info.is_first else (act,),
            output_args=(loss,) if info.is_last else (act,),
            group=group,
        )
        self.info = info
        # torch's input-gradient backward detaches the stage's output in place, which a view cannot be
        self.split_backward = split_backward
        self.context: _StepContext | None = None
        # the decoders whose 'block' recompute covers every layer for some microbatches (TransformerBlock)
        self.recompute_blocks = [m for m in unwrap_chunk(chunk).modules() if hasattr(m, "recompute_all_layers")]

    # torch's V schedules hand the input gradients between a rank's two stages even in a forward-only step, which
    # fails there (torch 2.13: "can't steal_bwd_input if this stage doesn't have backward"); without a backward
    # there is nothing to hand over, so evaluation runs their order with these hand-overs empty.
    def get_local_bwd_output(self, mb_index: int) -> tuple[torch.Tensor | None, ...]:
        return super().get_local_bwd_output(mb_index) if self.has_backward else ()

    def set_local_bwd_input(self, next_stage_bwd_outputs: tuple[torch.Tensor | None, ...], mb_index: int) -> None:
        if self.has_backward:
            super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)

    def forward_maybe_with_nosync(self, *args: Any, **kwargs: Any) -> Any:
        # torch's stage keeps DDP from reducing per microbatch; the reduction happens in the last backward.
        if isinstance(self.submod, DistributedDataParallel):
            with self.submod.no_sync():
                return self._run_forward_step(args)
        return self._run_forward_step(args)

    def _run_forward_step(self, args: tuple[Any, ...]) -> torch.Tensor:
        output = self._stage_output(args)
        return output.clone() if self.split_backward and output._is_view() else output

    def _stage_output(self, args: tuple[Any, ...]) -> torch.Tensor:
        ctx = self.context
        info = self.info
        model = self.submod if info.is_first else _StageInputModel(self.submod, args[0])
        all_layers = ctx.next_forward_recomputes_all_layers()
        for block in self.recompute_blocks:
            block.recompute_all_layers = all_layers
        try:
            with ctx.autocast():
                output_tensor, loss_func = ctx.forward_step_func(ctx.iterators[info.vp_index], model)
        finally:
            for block in self.recompute_blocks:
                block.recompute_all_layers = False
        if not info.is_last:
            if tuple(output_tensor.shape) != tuple(info.activation_shape):
                raise ConfigError(
                    f"pipeline stage {info.stage_index} produced activations of shape {tuple(output_tensor.shape)}, "
                    f"but stages exchange {tuple(info.activation_shape)} (micro_batch_size, seq_length, hidden_size); "
                    "every microbatch must have train.micro_batch_size samples of model.seq_length tokens"
                )
            return output_tensor.to(info.activation_dtype)
        return self._loss(loss_func(output_tensor))

    def _loss(self, outputs: Any) -> torch.Tensor:
        """Megatron's loss scaling, exactly as ``forward_backward_no_pipelining`` applies it."""
        ctx = self.context
        if len(outputs) == 3:
            loss, num_tokens, report = outputs
            ctx.total_tokens = ctx.total_tokens + num_tokens.detach().to(torch.int64).cpu()
            if not ctx.calculate_per_token_loss:
                loss = loss / num_tokens.clamp(min=1)
                loss = loss / ctx.num_microbatches
        elif len(outputs) == 2:
            loss, report = outputs
            loss = loss / ctx.num_microbatches
        else:
            raise TypeError("loss_func must return (loss, num_tokens, report) or (loss, report)")
        if not bool(torch.isfinite(loss.detach()).all()):
            ctx.finite = False
        ctx.reports.append(report)
        if ctx.grad_scale_func is not None:
            loss = ctx.grad_scale_func(loss)
        return loss.float().reshape(())


def _identity_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return output


class _PipelineRuntime:
    """The stages and schedule of one (num_microbatches, forward_only) combination, built once and reused."""

    def __init__(self, model: list[nn.Module], infos: list[PipelineChunkInfo], num_microbatches: int,
                 forward_only: bool, schedule: str, parallel: Any) -> None:
        group = parallel.pp_group
        spec = _schedule_spec(schedule, infos[0], len(model))
        self.stages = [_ForwardStepStage(chunk, info, parallel.device, group, spec.zero_bubble)
                       for chunk, info in zip(model, infos)]
        loss_fn = None if forward_only else _identity_loss
        schedule_class = getattr(pipelining, spec.torch_class)
        stages = self.stages if spec.multi_stage else self.stages[0]
        try:
            self.schedule = schedule_class(stages, num_microbatches, loss_fn=loss_fn, scale_grads=False)
        except ValueError as error:  # torch's own stage and microbatch count checks, as one line
            raise ConfigError(f"model.pipeline_parallel_schedule={spec.name!r}: {error}") from None
        self.forward_only = forward_only
        self.num_microbatches = num_microbatches
        self.partial_checkpoints = None if forward_only else _partial_checkpoint_window(self.stages, num_microbatches)

    def run(self, ctx: _StepContext) -> None:
        ctx.partial_checkpoints = self.partial_checkpoints
        for stage in self.stages:
            stage.context = ctx
        n = self.num_microbatches
        # The first stage's root input is the microbatch index; the target is unused (the loss is the output).
        indices = torch.arange(n, dtype=torch.long, device=self.stages[0].device)
        try:
            if self.forward_only:
                with torch.no_grad():
                    self.schedule.step(indices, return_outputs=False)
            else:
                self.schedule.step(indices, target=torch.zeros(n), return_outputs=False)
        finally:
            for stage in self.stages:
                stage.context = None


def _schedule_spec(schedule: str, info: PipelineChunkInfo, chunks: int) -> PipelineSchedule:
    """The ``PipelineSchedule`` of a ``forward_backward_pipelining`` schedule name for this rank's chunks."""
    if schedule == "auto":
        spec = resolve_schedule(info.schedule, chunks)
    elif schedule in _ALIASES or schedule in SCHEDULE_TABLE:
        spec = SCHEDULE_TABLE[_ALIASES.get(schedule, schedule)]
    else:
        raise ConfigError(f"pipeline schedule {schedule!r} is not one of {', '.join(SCHEDULES)}")
    if not spec.multi_stage and chunks != 1:
        raise ConfigError(
            f"pipeline schedule {spec.name!r} runs one model chunk per rank, but this rank holds {chunks} "
            "(model.virtual_pipeline_model_parallel_size): use 'Interleaved1F1B'"
        )
    if spec.v_shape != info.v_shape:
        raise ConfigError(
            f"pipeline schedule {spec.name!r} needs the stages placed {'in a V' if spec.v_shape else 'in a loop'}: "
            "build the chunks with that model.pipeline_parallel_schedule"
        )
    return spec


def _partial_checkpoint_window(stages: list[_ForwardStepStage], num_microbatches: int) -> tuple[int, int] | None:
    """(N, window) of num_microbatches_with_partial_activation_checkpoints on this rank: the window is
    megatron-core's warmup forwards + 1 (get_pp_rank_microbatches; interleaved groups of pp microbatches per
    virtual stage, as torch's interleaved schedule runs them)."""
    counts = {block.partial_checkpoint_microbatches for stage in stages for block in stage.recompute_blocks}
    counts.discard(None)
    if not counts:
        return None
    info = stages[0].info
    chunks = len(stages)
    if chunks == 1:
        warmup = info.pp_size - info.pp_rank - 1
    else:
        warmup = (info.pp_size - info.pp_rank - 1) * 2 + (chunks - 1) * info.pp_size
    warmup = min(warmup, num_microbatches * chunks)
    return min(counts), warmup + 1


def _runtime(model: list[nn.Module], num_microbatches: int, forward_only: bool, schedule: str,
             parallel: Any) -> _PipelineRuntime:
    infos = [chunk_info(chunk) for chunk in model]
    if any(info is None for info in infos):
        raise ValueError(
            "forward_backward_pipelining needs the chunks of longspan.parallel.pipeline.build_pipeline_chunks"
        )
    cache: dict = model[0].__dict__.setdefault(_CACHE_ATTR, {})
    key = (num_microbatches, forward_only, schedule, len(model))
    if key not in cache:
        cache[key] = _PipelineRuntime(model, infos, num_microbatches, forward_only, schedule, parallel)
    return cache[key]


def _last_stage_global_rank(parallel: Any, info: PipelineChunkInfo) -> int:
    """The global rank holding the last stage (the last pipeline rank; the first in a V shape)."""
    rank = stage_rank(info.num_stages - 1, info.pp_size, info.v_shape)
    return dist.get_process_group_ranks(parallel.pp_group)[rank]


def _share_from_last_stage(ctx: _StepContext, parallel: Any, info: PipelineChunkInfo) -> None:
    """Broadcast the reports, token count and finiteness from the last pipeline stage to the others."""
    payload = [(ctx.reports, ctx.total_tokens, ctx.finite)]
    src = _last_stage_global_rank(parallel, info)
    device = parallel.device if parallel.device.type == "cuda" else None
    if dist.get_rank() == src:
        payload[0] = (
            [{k: (v.detach().cpu() if torch.is_tensor(v) else v) for k, v in r.items()} for r in ctx.reports],
            ctx.total_tokens,
            ctx.finite,
        )
    dist.broadcast_object_list(payload, src=src, group=parallel.pp_group, device=device)
    ctx.reports, ctx.total_tokens, ctx.finite = payload[0]


def forward_backward_pipelining(
    *,
    forward_step_func: Callable,
    data_iterator: Iterator | list[Iterator],
    model: list[torch.nn.Module],
    num_microbatches: int,
    forward_only: bool = False,
    calculate_per_token_loss: bool = False,
    grad_scale_func: Callable[[torch.Tensor], torch.Tensor] | None = None,
    autocast_dtype: torch.dtype | None = None,
    device_type: str = "cpu",
    check_for_nan: bool = True,
    iteration: int | None = None,
    schedule: str = "auto",
    parallel: Any = None,
) -> tuple[list[dict[str, Any]], torch.Tensor]:
    """Run ``num_microbatches`` through the pipeline (forward, and backward unless ``forward_only``).

    Same keyword arguments and return value as ``forward_backward_no_pipelining``: the per-microbatch loss
    reports and the total token count, identical on every pipeline rank. ``data_iterator`` is one iterator
    (read ``num_microbatches`` times, each microbatch given to every local chunk) or a list with one iterator
    per local chunk (Megatron's virtual-pipeline form). Extra: ``schedule`` (one of ``SCHEDULES``) and
    ``parallel`` (default: the process's ``ParallelState``).
    """
    if parallel is None:
        parallel = get_parallel_state()
    runtime = _runtime(model, num_microbatches, forward_only, schedule, parallel)
    set_moe_aux_loss_scale(grad_scale_func, num_microbatches, calculate_per_token_loss)
    ctx = _StepContext(forward_step_func, num_microbatches, calculate_per_token_loss, grad_scale_func,
                       autocast_dtype, device_type, forward_only)
    if isinstance(data_iterator, (list, tuple)):
        ctx.iterators = {stage.info.vp_index: data_iterator[stage.info.vp_index] for stage in runtime.stages}
    else:
        microbatches = [next(data_iterator) for _ in range(num_microbatches)] if data_iterator is not None else []
        ctx.iterators = {stage.info.vp_index: iter(microbatches) for stage in runtime.stages}

    with parallel_loss_context(model):
        runtime.run(ctx)
    _share_from_last_stage(ctx, parallel, runtime.stages[0].info)
    if check_for_nan and not ctx.finite:
        check_finite(torch.tensor(float("nan")), "the loss", iteration)
    if not forward_only:
        sync_tied_embedding_grads(model, parallel)
    return ctx.reports, ctx.total_tokens
