"""The multi-token-prediction losses for the training log (megatron-core's ``MTPLossLoggingHelper``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from longspan.config.schema.container import ConfigContainer
from longspan.training.state import GlobalState


def track_mtp_metrics(model: list, config: ConfigContainer, global_state: GlobalState) -> dict[str, float]:
    """The iteration's ``mtp_{k} loss`` per depth ``k`` (empty without MTP): each microbatch's
    ``sum(mask * ce) / sum(mask)`` averaged over the microbatches and the data-parallel ranks, as megatron-core
    logs them; the accumulators are then cleared. Collective over the pipeline and data-parallel groups (only
    the last stage holds the depths): call on every rank."""
    depths = config.model.mtp_num_layers
    if not depths:
        return {}
    # model code on first use: train_utils and the loggers import no model module (tests/training/test_state.py)
    from longspan.models.mtp import mtp_blocks

    chunks = model if isinstance(model, list) else [model]
    # [depths sums..., microbatches]: zeros on stages without the depths, summed across stages and ranks
    table = torch.zeros(int(depths) + 1, dtype=torch.float64)
    for block in mtp_blocks(chunks):
        sums, steps = block.take_losses()
        table[: len(sums)] += torch.tensor(sums, dtype=torch.float64)
        table[-1] += steps
    parallel = getattr(global_state, "parallel", None)
    if parallel is not None and dist.is_initialized():
        for group, size in ((parallel.pp_group, parallel.pp_size), (parallel.dp_group, parallel.dp_size)):
            if size > 1:
                device = _group_device(group)
                reduced = table.to(device)
                dist.all_reduce(reduced, group=group)
                table = reduced.cpu()
    if table[-1] <= 0:
        return {}
    return {f"mtp_{k + 1} loss": float(table[k] / table[-1]) for k in range(int(depths))}


def _group_device(group: Any) -> torch.device:
    """Where a collective on ``group`` takes its tensors: the GPU under NCCL, else the CPU."""
    backend = dist.get_backend(group)
    if backend == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
