"""Token permutation for the MoE layer: rows grouped by expert on the device, and weighted back per token.

``permute`` finds the routed (token, expert) pairs of a routing map ``[T, E]`` in expert-major order with a
static-size nonzero (the row count comes from the router, so nothing is read on the host: Megatron's
``moe_permute_fusion`` meaning); ``unpermute`` weights each expert output row by its routing probability and
sums the rows back per token. ``split_by_expert`` / ``pad_rows`` serve the expert-by-expert loop, which reads
the counts on the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Permutation:
    """Where the rows of a permutation came from (``permute``); everything on the device.

    ``rows`` permuted rows hold the routed (token, expert) pairs expert-major, in token order within an expert,
    then padding rows (when token dropping kept fewer pairs than the static row count)."""

    token_index: torch.Tensor
    """``[rows]`` the token of each row (0 for padding rows)."""
    map_index: torch.Tensor
    """``[rows]`` each row's position in the expert-major routing map ``[E * T]`` (clamped for padding rows)."""
    valid: Optional[torch.Tensor]
    """``[rows]`` bool, False on padding rows; None when the row count is exact (no padding)."""
    tokens_per_expert: torch.Tensor
    """``[E]`` int64 rows of each expert."""


def permute(x: torch.Tensor, routing_map: torch.Tensor,
            rows: Optional[tuple[int, bool]] = None) -> tuple[torch.Tensor, Permutation]:
    """Rows of ``x [T, h]`` grouped by expert (expert-major, token order within an expert), found on the
    device (a static-size nonzero over the expert-major map: Megatron's permute with the row count known).

    ``rows`` is ``(count, exact)`` from ``TopKRouter.routed_rows``: the number of routed pairs, or a bound on it
    (then the tail is padding). None reads the count from the map on the host.
    """
    num_tokens, num_experts = routing_map.shape
    expert_major = routing_map.t().reshape(-1)
    if rows is None:
        rows = (int(expert_major.sum()), True)
    count, exact = rows
    size = num_experts * num_tokens
    flat = torch.nonzero_static(expert_major, size=count, fill_value=size).squeeze(1)
    valid = None if exact else flat < size
    token_index = torch.remainder(flat, num_tokens)
    tokens_per_expert = routing_map.sum(dim=0)
    return x.index_select(0, token_index), Permutation(token_index, flat.clamp(max=size - 1), valid,
                                                       tokens_per_expert)


def unpermute(y: torch.Tensor, probs: torch.Tensor, permutation: Permutation, num_tokens: int) -> torch.Tensor:
    """Weight each expert output row by its routing probability and sum the rows back per token."""
    weights = probs.t().reshape(-1).index_select(0, permutation.map_index)
    if permutation.valid is not None:
        weights = weights * permutation.valid
    out = y.new_zeros(num_tokens, y.shape[-1])
    return out.index_add(0, permutation.token_index, (y.float() * weights.float().unsqueeze(-1)).to(y.dtype))


def split_by_expert(x: torch.Tensor, tokens_per_expert: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The rows of each expert (``tokens_per_expert`` read on the host), leaving out padding rows past them."""
    counts = tokens_per_expert.tolist()
    return torch.split(x[:sum(counts)], counts, dim=0)


def pad_rows(y: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``y`` followed by zero rows up to ``num_rows`` rows."""
    return F.pad(y, (0, 0, 0, num_rows - y.shape[0])) if y.shape[0] < num_rows else y
