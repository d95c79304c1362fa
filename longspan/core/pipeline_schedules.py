"""The pipeline schedules ``model.pipeline_parallel_schedule`` selects: names, stage placement, bubble. No torch.

The names are torchtitan's (``parallelism.pipeline_parallel_schedule``: torch's ``torch.distributed.pipelining``
class without its ``Schedule`` prefix); Megatron and Megatron Bridge have no such field (they pick 1F1B, or
interleaved 1F1B with ``virtual_pipeline_model_parallel_size``), which is what ``None`` means here.

Placement: the loop schedules put virtual stage ``s`` on pipeline rank ``s % pp`` as its chunk ``s // pp``
(Megatron's interleaving). The V-shaped ones (``ZBVZeroBubble``, ``DualPipeV``) put exactly two stages on each
rank, stage ``r`` and stage ``2 pp - 1 - r`` (torch's ``style="v"``), so rank 0 holds the first and the last
stage. The zero-bubble schedules split each backward into the input gradient (sent upstream at once) and the
weight gradient (run later to fill the bubble); torch does the split on the stage's autograd graph, so the
stage modules need nothing of their own.

Bubble: idle time over useful time per step, in the time units of DeepSeek-V3's Table 2 (and the DualPipe
README) with the usual ratios forward F = weight gradient W = input gradient (so the full backward B = 2F):
1F1B (p-1)(F+B) -> (p-1)/m; ZB1P (p-1)(F+B-2W) -> (p-1)/(3m), the ZB paper's ZB-H1 (arXiv 2401.10241 §3.1);
DualPipeV (p-1)(F&B+B-3W) with the overlapped F&B counted as F+B (torch overlaps communication, not two
computations) -> (p-1)/(3m); ZB-V zero (ZB paper §6) once there are 2p-1 microbatches, the count torch's ZBV
schedule is built for (fewer leave its slots idle: (2p-1-m)/m). Interleaving over v chunks divides the loop
schedules' bubble by v (Megatron's interleaved 1F1B).
"""

from __future__ import annotations

from dataclasses import dataclass

from longspan.core.errors import ConfigError


@dataclass(frozen=True)
class PipelineSchedule:
    """One selectable schedule.

    Attributes:
        name: the config value (torchtitan's name).
        torch_class: the ``torch.distributed.pipelining`` class that runs it.
        multi_stage: runs several stages per rank (a list of stages); else exactly one.
        v_shape: two stages per rank, stage r and 2 pp - 1 - r.
        zero_bubble: splits the backward into input and weight gradients.
    """

    name: str
    torch_class: str
    multi_stage: bool
    v_shape: bool = False
    zero_bubble: bool = False


SCHEDULES: dict[str, PipelineSchedule] = {
    s.name: s
    for s in (
        PipelineSchedule("1F1B", "Schedule1F1B", multi_stage=False),
        PipelineSchedule("GPipe", "ScheduleGPipe", multi_stage=False),
        PipelineSchedule("Interleaved1F1B", "ScheduleInterleaved1F1B", multi_stage=True),
        PipelineSchedule("InterleavedZeroBubble", "ScheduleInterleavedZeroBubble", multi_stage=True,
                         zero_bubble=True),
        PipelineSchedule("ZBVZeroBubble", "ScheduleZBVZeroBubble", multi_stage=True, v_shape=True, zero_bubble=True),
        PipelineSchedule("DualPipeV", "ScheduleDualPipeV", multi_stage=True, v_shape=True, zero_bubble=True),
    )
}


def resolve_schedule(name: str | None, stages_per_rank: int = 1) -> PipelineSchedule:
    """The schedule ``name`` selects; None: Megatron's choice (1F1B, interleaved 1F1B with several stages)."""
    if name is None:
        return SCHEDULES["Interleaved1F1B" if stages_per_rank > 1 else "1F1B"]
    if name not in SCHEDULES:
        raise ConfigError(
            f"model.pipeline_parallel_schedule={name!r} is not a pipeline schedule: use None (1F1B, interleaved "
            f"with virtual_pipeline_model_parallel_size) or one of {', '.join(SCHEDULES)}"
        )
    return SCHEDULES[name]


def rank_stages(rank: int, pp: int, num_stages: int, v_shape: bool) -> list[int]:
    """The stages pipeline rank ``rank`` holds, in chunk order (its chunk k is the k-th)."""
    if v_shape:
        return [rank, 2 * pp - 1 - rank]
    return list(range(rank, num_stages, pp))


def stage_rank(stage: int, pp: int, v_shape: bool) -> int:
    """The pipeline rank holding ``stage``."""
    if v_shape and stage >= pp:
        return 2 * pp - 1 - stage
    return stage % pp


def bubble_fraction(schedule: PipelineSchedule, pp: int, microbatches: int, stages_per_rank: int = 1) -> float:
    """Idle over useful time of one step (see the module docstring for the formulas and their sources)."""
    if pp <= 1:
        return 0.0
    m = max(1, microbatches)
    if schedule.name == "ZBVZeroBubble":
        return max(0, 2 * pp - 1 - m) / m
    if schedule.name == "DualPipeV":
        return (pp - 1) / (3 * m)
    bubble = (pp - 1) / m
    if schedule.zero_bubble:
        bubble /= 3
    return bubble / (stages_per_rank if schedule.multi_stage else 1)
