"""The router's aux losses on a split sequence (``longspan.models.moe_router.SequenceShards``), on one process.

A microbatch's tokens are routed as two context-parallel ranks would route them (rank 0: the first and last
quarter, rank 1: the middle, the load-balanced split), each with a ``SequenceShards`` whose ``sum`` adds the
other rank's token counts (recorded in a first pass). The layout's rules then give the whole microbatch's
results: the logged load-balancing loss and z-loss averaged over the two ranks (``track_moe_metrics`` averages
over data × context ranks) equal one process's, and so does the router gradient averaged over them (the
data-parallel wrappers average over data × context ranks), for softmax and for sigmoid routing, with the aux
losses as microbatch means or scaled by the microbatch's token count (``calculate_per_token_loss``).
"""

from __future__ import annotations

import pytest
import torch

from longspan.models.args import MoEArgs
from longspan.models.moe_router import SequenceShards, TopKRouter, set_aux_loss_scale

HIDDEN, EXPERTS, TOKENS = 16, 8, 24


def _router(score_function: str, per_token: bool) -> TopKRouter:
    moe = MoEArgs(num_experts=EXPERTS, topk=2, ffn_hidden_size=8, shared_ffn_hidden_size=None,
                  shared_expert_gate=False, layer_flags=[True], aux_loss_coeff=1e-2, z_loss_coeff=1e-3,
                  pre_softmax=False, score_function=score_function, num_groups=None, group_topk=None,
                  topk_scaling_factor=None, router_dtype=None, capacity_factor=None, drop_policy="probs",
                  pad_to_capacity=False, per_layer_logging=False, calculate_per_token_loss=per_token)
    router = TopKRouter(HIDDEN, moe, init_std=0.5, dtype=torch.float32)
    with torch.no_grad():
        router.weight.copy_(torch.randn(EXPERTS, HIDDEN, generator=torch.Generator().manual_seed(3)) * 0.5)
    return router.train()


def _route(router: TopKRouter, x: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """(tracked losses, the aux losses' gradient of the router weight) for tokens ``x``."""
    router.weight.grad = None
    probs, _ = router(x)
    (probs * 0).sum().backward()  # only the attached aux losses send a gradient
    return dict(router.last_tracked), router.weight.grad.clone()


@pytest.mark.parametrize("per_token", [False, True], ids=["mean", "per_token"])
@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_split_sequence_aux_losses_average_to_the_whole_microbatch(score_function, per_token):
    set_aux_loss_scale(1.0)
    router = _router(score_function, per_token)
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(5))
    whole_tracked, whole_grad = _route(router, x)

    q = TOKENS // 4
    shares = [torch.cat([x[:q], x[3 * q:]]), x[q:3 * q]]  # ranks 0 and 1 of the load-balanced split
    counts: dict[int, torch.Tensor] = {}
    for rank, share in enumerate(shares):  # first pass: each rank's own token counts
        router.sequence_shards = SequenceShards(size=2, sum=lambda c, rank=rank: counts.setdefault(rank, c.clone()))
        _route(router, share)
    results = []
    for rank, share in enumerate(shares):
        other = counts[1 - rank]
        router.sequence_shards = SequenceShards(size=2, sum=lambda c, other=other: c + other)
        results.append(_route(router, share))

    for name in ("load_balancing_loss", "z_loss"):
        averaged = sum(tracked[name] for tracked, _ in results) / 2
        torch.testing.assert_close(averaged, whole_tracked[name], rtol=1e-6, atol=0)
    averaged_grad = sum(grad for _, grad in results) / 2
    assert float(whole_grad.abs().max()) > 0
    torch.testing.assert_close(averaged_grad, whole_grad, rtol=1e-5, atol=1e-9)
    # without the rule (each rank's own loss, as if its chunks were the whole sequence) the gradient differs
    router.sequence_shards = None
    local_grad = sum(_route(router, share)[1] for share in shares) / 2
    assert not torch.allclose(local_grad, whole_grad, rtol=1e-3, atol=0)
