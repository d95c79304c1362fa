"""Gradients left as partial sums, reduced once per step in one collective.

Under sequence parallel a replicated parameter (a norm weight, the bias of a row-wise projection) is applied
to each rank's shard of the sequence, so its gradient is a DTensor with a ``Partial`` placement: every rank
holds a partial sum. Left so, the gradient norm and then the optimizer would each reduce every such gradient
(one all-reduce per parameter, twice per step). ``reduce_partial_grads`` reduces them together, one
collective per mesh, placements and dtype, and stores the sums (``Replicate`` where they were ``Partial``),
as Megatron all-reduces the sequence-parallel norm gradients once in ``finalize_model_grads``. The sums are
the ones the per-parameter reductions computed.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable

import torch

from longspan.training.optim.precision_aware_adam import main_grad

try:  # DTensor is part of torch.distributed; absent only on builds without distributed support.
    from torch.distributed.tensor import DTensor, Replicate
except ImportError:  # pragma: no cover
    DTensor = None  # type: ignore[assignment,misc]


def _partial_only(grad: Any) -> bool:
    """A DTensor gradient that is a partial sum on some mesh dimension and sharded on none (a flat
    concatenation of such gradients reduces like each of them)."""
    return (DTensor is not None and isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements)
            and all(p.is_partial() or p.is_replicate() for p in grad.placements))


@torch.no_grad()
def reduce_partial_grads(params: Iterable[torch.Tensor]) -> int:
    """Reduce every partial-sum gradient of ``params`` in place of the per-parameter reductions; returns the
    number of collectives issued."""
    groups: dict[Any, list[tuple[torch.Tensor, str, DTensor]]] = defaultdict(list)
    for param in params:
        grad = main_grad(param)  # the gradient the step uses: ``decoupled_grad`` when set, else ``grad``
        slot = "grad" if grad is param.grad else "decoupled_grad"
        if _partial_only(grad):
            groups[(id(grad.device_mesh), grad.placements, grad.dtype, grad.device)].append((param, slot, grad))
    for members in groups.values():
        mesh, placements = members[0][2].device_mesh, members[0][2].placements
        summed = tuple(Replicate() if p.is_partial() else p for p in placements)
        flat = torch.cat([grad.to_local().reshape(-1) for _, _, grad in members])
        flat = DTensor.from_local(flat, mesh, placements, run_check=False).redistribute(mesh, summed).to_local()
        offset = 0
        for param, slot, grad in members:
            local = grad.to_local()
            values = flat[offset:offset + local.numel()].view(local.shape)
            offset += local.numel()
            setattr(param, slot, DTensor.from_local(values, mesh, summed, run_check=False, shape=grad.shape,
                                                    stride=grad.stride()))
    return len(groups)
