"""Rules of ``model.pipeline_parallel_schedule``: the stage count, microbatch count and layout each schedule
can run (``longspan.core.pipeline_schedules`` lists them; torch.distributed.pipelining runs them)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from longspan.core.errors import ConfigError, NotSupportedError
from longspan.core.pipeline_schedules import PipelineSchedule, resolve_schedule

if TYPE_CHECKING:
    from longspan.config.schema.container import ConfigContainer


def check_pipeline_schedule(cfg: "ConfigContainer", data_parallel_size: int, num_microbatches: int) -> None:
    """The selected schedule fits the pipeline's stages, microbatches and layout (one line naming the field)."""
    m = cfg.model
    name = m.pipeline_parallel_schedule
    if name is None:
        return
    pp = m.pipeline_model_parallel_size
    vp = m.virtual_pipeline_model_parallel_size
    field = f"model.pipeline_parallel_schedule={name!r}"
    schedule = resolve_schedule(name, vp or 1)
    if pp < 2:
        raise ConfigError(f"{field} needs model.pipeline_model_parallel_size > 1 (it is {pp}); unset it")
    if not schedule.multi_stage and vp is not None:
        raise ConfigError(
            f"{field} runs one stage per pipeline rank, but model.virtual_pipeline_model_parallel_size={vp} puts "
            "several on each: use 'Interleaved1F1B', 'InterleavedZeroBubble' or unset it"
        )
    if schedule.v_shape:
        _check_v_shape(cfg, field, vp)
    if schedule.zero_bubble:
        _check_zero_bubble(cfg, field, data_parallel_size)
    _check_microbatches(cfg, schedule, field, num_microbatches)


def _check_v_shape(cfg: "ConfigContainer", field: str, vp: int | None) -> None:
    m = cfg.model
    if vp != 2:
        raise ConfigError(
            f"{field} places exactly two stages on each pipeline rank (stage r and 2 x pp - 1 - r): set "
            f"model.virtual_pipeline_model_parallel_size=2 (it is {vp})"
        )
    for uneven in ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage"):
        if getattr(m, uneven) is not None:
            raise NotSupportedError(
                f"model.{uneven}={getattr(m, uneven)} is not supported yet with {field}: the first pipeline rank "
                "holds both the first and the last stage; use account_for_embedding/loss_in_pipeline_split"
            )
    if m.share_embeddings_and_output_weights or m.mtp_num_layers:
        raise NotSupportedError(
            f"{field} with tied embeddings or multi-token prediction (model.share_embeddings_and_output_weights="
            f"{m.share_embeddings_and_output_weights}, model.mtp_num_layers={m.mtp_num_layers}) is not supported "
            "yet: both copies of the embedding would sit on pipeline rank 0; use 'InterleavedZeroBubble'"
        )


def _check_zero_bubble(cfg: "ConfigContainer", field: str, data_parallel_size: int) -> None:
    m = cfg.model
    replicas = data_parallel_size * m.context_parallel_size
    if replicas > 1:
        raise NotSupportedError(
            f"{field} is not supported yet with data-parallel x context-parallel size {replicas}: torch writes the "
            "split backward's weight gradients outside the hooks DDP and FSDP2 reduce with; use pipeline and "
            "tensor parallel only, or '1F1B' / 'Interleaved1F1B'"
        )
    if m.num_microbatches_with_partial_activation_checkpoints is not None:
        raise NotSupportedError(
            f"model.num_microbatches_with_partial_activation_checkpoints="
            f"{m.num_microbatches_with_partial_activation_checkpoints} is not supported yet with {field}: its "
            "window of in-flight microbatches is Megatron's 1F1B one"
        )


def _check_microbatches(cfg: "ConfigContainer", schedule: PipelineSchedule, field: str, n: int) -> None:
    """torch's own microbatch rules for the schedule, named by the fields that set the count."""
    pp = cfg.model.pipeline_model_parallel_size
    count = (f"{n} microbatches (train.global_batch_size={cfg.train.global_batch_size} / (micro_batch_size "
             f"{cfg.train.micro_batch_size} x data-parallel size))")
    if schedule.name == "DualPipeV" and n < 2 * pp:
        raise ConfigError(f"{count} is fewer than the {2 * pp} stages {field} needs at least one microbatch each")
    if schedule.name in ("Interleaved1F1B", "InterleavedZeroBubble"):
        rounds = max(1, n // pp)
        if n % rounds != 0:
            raise ConfigError(f"{count} is not a multiple of the {rounds} rounds of pp microbatches {field} runs")
