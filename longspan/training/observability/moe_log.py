"""The MoE layers' per-iteration metrics for the training log (Megatron's ``track_moe_metrics``)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from longspan.config.schema.container import ConfigContainer
from longspan.training.observability.loggers import log_scalars
from longspan.training.state import GlobalState
from longspan.training.observability.log_sinks import logger_sinks


def track_moe_metrics(model: list, config: ConfigContainer, global_state: GlobalState,
                      iteration: int) -> dict[str, float]:
    """Megatron's ``track_moe_metrics``: the MoE layers' metrics of the iteration just finished, then reset.

    Returns (empty for a dense model) ``load_balancing_loss`` and ``z_loss`` (when enabled; without their
    coefficients, averaged over microbatches, MoE layers and data × context-parallel ranks, as Megatron logs
    them) and ``load_imbalance``: per layer the busiest expert's token count over the mean count (1.0 = balanced;
    tokens summed over microbatches and data × context-parallel ranks), averaged over layers. With
    ``moe_per_layer_logging`` each layer's values also go to the sinks as ``moe/<name>_layer_<i>`` every
    ``tensorboard_log_interval``.
    Collective over the pipeline and data × context-parallel groups: call on every rank.
    """
    model_cfg = config.model
    if not model_cfg.num_moe_experts:
        return {}
    # model code on first use: train_utils and the loggers import no model module (tests/training/test_state.py)
    from longspan.models.moe import moe_layer_metrics, reset_moe_metrics

    chunks = model if isinstance(model, list) else [model]
    per_layer = moe_layer_metrics(chunks)
    reset_moe_metrics(chunks)
    # MTP depths' MoE layers are numbered after the decoder's (megatron-core counts them too)
    num_layers = int(model_cfg.num_layers) + int(model_cfg.mtp_num_layers or 0)
    experts = int(model_cfg.num_moe_experts)
    names = ["load_balancing_loss", "z_loss"]
    # [num_layers, 2 losses + steps + experts]: zeros for layers on other pipeline stages, summed across them.
    table = torch.zeros(num_layers, len(names) + 1 + experts, dtype=torch.float64)
    present = torch.zeros(len(names), dtype=torch.float64)
    for layer, values in per_layer.items():
        for j, name in enumerate(names):
            if name in values:
                table[layer, j] = values[name]
                present[j] = 1.0
        table[layer, len(names)] = values["steps"]
        table[layer, len(names) + 1:] = values["tokens_per_expert"]
    parallel = getattr(global_state, "parallel", None)
    if parallel is not None and dist.is_initialized():
        groups = [parallel.pp_group] if parallel.pp_size > 1 else []
        # data × context parallel: context-parallel ranks route different chunks of the same sequences
        if parallel.size("dp_cp") > 1:
            groups.append(parallel.dp_cp_group)
        for group in groups:
            dist.all_reduce(table, group=group)
            dist.all_reduce(present, op=dist.ReduceOp.MAX, group=group)
    steps = table[:, len(names)]
    moe_rows = steps > 0
    if not bool(moe_rows.any()):
        return {}
    out: dict[str, float] = {}
    layer_values: dict[str, torch.Tensor] = {}
    for j, name in enumerate(names):
        if present[j] > 0:
            # steps were summed over dp × cp ranks too, so sum/steps is the mean over microbatches and ranks
            layer_values[name] = table[moe_rows, j] / steps[moe_rows]
    tokens = table[moe_rows, len(names) + 1:]
    layer_values["load_imbalance"] = tokens.max(dim=1).values / tokens.mean(dim=1).clamp(min=1e-12)
    for name, vals in layer_values.items():
        out[name] = float(vals.mean())
    tb_interval = max(1, int(config.logger.tensorboard_log_interval or 1))
    if model_cfg.moe_per_layer_logging and iteration % tb_interval == 0:
        layer_ids = torch.nonzero(moe_rows).flatten().tolist()
        scalars = {f"moe/{name}_layer_{i}": float(v) for name, vals in layer_values.items()
                   for i, v in zip(layer_ids, vals.tolist())}
        log_scalars(scalars, iteration, **logger_sinks(global_state))
    return out
