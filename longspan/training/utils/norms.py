"""Parameter and gradient norms that are correct under every parallel layout.

longspan's parallelism is DTensor-based: FSDP2 shards parameters as ``Shard(0)`` DTensors over the
data-parallel mesh, tensor parallel plans shard them over the tp mesh, and everything else is replicated.
The norm of the full model therefore is: for each DTensor, the local sum of squares, summed over the mesh
dimensions where it is *sharded* (a replicated dimension already holds the full value on every rank, so it is
counted once); plain tensors on a data-parallel replicated model are whole on every rank, so their local
sum of squares is already the global one. Parameters marked ``shared=True`` (a second reference to a tied
weight) are counted once, as are parameters that appear in several model chunks.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Iterable, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from longspan.training.utils.comm import collective_device, dist_ready, group_size


def param_is_not_shared(param: nn.Parameter) -> bool:
    """True if ``param`` has no ``shared`` attribute or ``param.shared`` is False.

    A parameter marked ``shared=True`` is a second handle on a weight already counted elsewhere (e.g. the
    output layer tied to the embedding); norms and counts skip it.
    """
    return not getattr(param, "shared", False)


def _as_model_list(model: Union[nn.Module, list[nn.Module]]) -> list[nn.Module]:
    return model if isinstance(model, list) else [model]


def _local_sumsq(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of squares of ``tensors`` in float32, as a 1-element tensor on ``device``."""
    total = torch.zeros(1, dtype=torch.float32, device=device)
    for t in tensors:
        if t.numel() == 0:
            continue
        # vector_norm with dtype=float32 upcasts inside the kernel: no full-size fp32 copy of bf16 weights.
        total += torch.linalg.vector_norm(t, ord=2, dtype=torch.float32).to(device) ** 2
    return total


def _dtensor_sumsq(params: Iterable[DTensor]) -> Optional[torch.Tensor]:
    """Global sum of squares of DTensors: local sums all-reduced over each *sharded* mesh dimension.

    Parameters are grouped by (mesh, placements) so each group costs one all-reduce per sharded dimension.
    Every rank of each mesh must call this with the same parameters in the same order (true for SPMD
    models). Returns None when ``params`` is empty.
    """
    groups: "OrderedDict[tuple, list[torch.Tensor]]" = OrderedDict()
    meshes: dict[tuple, Any] = {}
    for p in params:
        key = (id(p.device_mesh), tuple(p.placements))
        meshes[key] = (p.device_mesh, p.placements)
        groups.setdefault(key, []).append(p.to_local())
    if not groups:
        return None
    total: Optional[torch.Tensor] = None
    for key, local_tensors in groups.items():
        mesh, placements = meshes[key]
        sumsq = _local_sumsq(local_tensors, local_tensors[0].device)
        for mesh_dim, placement in enumerate(placements):
            if placement.is_shard():
                dist.all_reduce(sumsq, op=dist.ReduceOp.SUM, group=mesh.get_group(mesh_dim))
            elif placement.is_replicate():
                continue  # every rank holds the full value along this dimension: count it once
            else:
                raise RuntimeError(
                    f"cannot compute a parameter norm for a DTensor with placement {placement} "
                    "(only Shard and Replicate are supported)"
                )
        sumsq = sumsq.cpu()
        total = sumsq if total is None else total + sumsq
    return total


def calc_dtensor_params_l2_norm(params: Iterable[DTensor]) -> float:
    """L2 norm of DTensor parameters (sharded dimensions reduced, replicated ones counted once).

    Every rank of the parameters' meshes must call this with the same parameters in the same order.
    """
    sumsq = _dtensor_sumsq(list(params))
    return 0.0 if sumsq is None else float(sumsq.item()) ** 0.5


def _pipeline_group(model: list[nn.Module]) -> Optional[Any]:
    """The pipeline-parallel group of the model chunks, if they carry one (``chunk.pg_collection.pp``)."""
    for chunk in model:
        pg_collection = getattr(chunk, "pg_collection", None)
        pp = getattr(pg_collection, "pp", None) if pg_collection is not None else None
        if pp is not None:
            return pp
    return None


def calc_params_l2_norm(
    model: Union[nn.Module, list[nn.Module]],
    model_config: Any,
    use_megatron_fsdp: bool = False,
    force_create_fp32_copy: bool = False,
) -> float:
    """L2 norm of all model parameters across every rank, counting each parameter once.

    Args:
        model: the model or list of model chunks.
        model_config: the model config; only ``bf16`` is read (bf16 weights are accumulated in fp32, which
            longspan always does).
        use_megatron_fsdp: Megatron FSDP requires every parameter to be a DTensor; when True a plain
            parameter is an error. longspan's FSDP2 parameters are DTensors either way.
        force_create_fp32_copy: ignore a parameter's ``main_param`` (an fp32 master copy kept by a
            mixed-precision optimizer) and use the parameter itself.

    Returns:
        The global L2 norm as a float. When the chunks carry a pipeline group (``chunk.pg_collection.pp``)
        with more than one rank, the squares are summed across pipeline stages too; every rank of that group
        must call this.
    """
    del model_config  # fp32 accumulation is unconditional
    chunks = _as_model_list(model)
    seen: set[int] = set()
    dtensors: list[DTensor] = []
    plain: list[torch.Tensor] = []
    device = torch.device("cpu")
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if id(param) in seen or not param_is_not_shared(param):
                continue
            seen.add(id(param))
            main = None if force_create_fp32_copy else getattr(param, "main_param", None)
            data = main if main is not None else param.detach()
            if isinstance(data, DTensor):
                dtensors.append(data)
            elif use_megatron_fsdp:
                raise RuntimeError(f"Megatron FSDP requires DTensor parameters; parameter {name} is not a DTensor")
            else:
                plain.append(data)
                device = data.device
    with torch.no_grad():
        total = _local_sumsq(plain, device).cpu()
        dtensor_total = _dtensor_sumsq(dtensors)
        if dtensor_total is not None:
            total = total + dtensor_total
        pp_group = _pipeline_group(chunks)
        if pp_group is not None and group_size(pp_group) > 1 and dist_ready():
            reduced = total.to(collective_device(pp_group))
            dist.all_reduce(reduced, op=dist.ReduceOp.SUM, group=pp_group)
            total = reduced.cpu()
    return float(total.item()) ** 0.5


def report_l2_norm_grad(model: Union[nn.Module, list[nn.Module]]) -> dict[str, float]:
    """L2 norm of the gradients, per parameter and overall.

    Call after gradients are reduced across ranks and unscaled. Uses ``param.main_grad`` when a wrapper
    keeps one, else ``param.grad``; DTensor gradients are reduced to their full-tensor norm (every rank of
    their mesh must call this).

    Returns:
        ``{"l2_norm/grad/<param name>": norm, ..., "l2_norm/grad/global": norm}``.
    """
    metrics: dict[str, float] = {}
    total_sq = 0.0
    for chunk in _as_model_list(model):
        for name, param in chunk.named_parameters():
            key = f"l2_norm/grad/{name}"
            if not param.requires_grad or key in metrics:
                continue
            grad = getattr(param, "main_grad", None)
            if grad is None:
                grad = param.grad
            if grad is None:
                continue
            with torch.no_grad():
                if isinstance(grad, DTensor):
                    sumsq = _dtensor_sumsq([grad])
                    norm = float(sumsq.item()) ** 0.5 if sumsq is not None else 0.0
                else:
                    norm = float(torch.linalg.vector_norm(grad, dtype=torch.float32).item())
            metrics[key] = norm
            total_sq += norm * norm
    metrics["l2_norm/grad/global"] = total_sq**0.5
    return metrics
