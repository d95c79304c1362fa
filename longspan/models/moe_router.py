"""The MoE router (``TopKRouter``) and its auxiliary losses, Megatron Core semantics in plain PyTorch
(``longspan.models.moe`` is the layer around it).

Routing (``TopKRouter``): logits = x @ router.weight^T (in ``moe_router_dtype``), then softmax-after-top-k
(default), softmax-before-top-k (``moe_router_pre_softmax``) or sigmoid scores normalized over the top-k;
optional group-limited top-k (device-limited routing is the same with one group per expert-parallel rank)
and a scaling factor; optional token dropping at the router with
``moe_expert_capacity_factor`` (Megatron's ``apply_router_token_dropping``: capacity per expert =
ceil(tokens * topk / experts * factor), drop policy 'probs' or 'position'). Dropping happens on the tokens
this rank routes, before any dispatch, so the dropped set does not depend on the expert-parallel layout.

Aux-loss-free balancing (``moe_router_enable_expert_bias``, sigmoid scores, DeepSeek-V3): a persistent float32
buffer ``router.expert_bias [E]`` is added to the scores to choose the top-k only; the routing weights stay
the unbiased scores. Each training forward (grad enabled, not an activation-recompute pass) adds the tokens
each expert received after dropping to ``router.local_tokens_per_expert`` (a plain tensor, not a buffer, so
no wrapper broadcasts it); once per optimizer step ``longspan.parallel.expert_parallel.update_expert_biases``
sums those counts over the data-parallel ranks and moves every bias by ``rate * sign(mean - count)``
(megatron-core's ``get_updated_expert_bias``), identically on every rank.

Input jitter (``moe_input_jitter_eps``): while training, the router's input (not the experts') is multiplied
by noise uniform in [1 - eps, 1 + eps], drawn like megatron-core's from torch's global generator (unlike
megatron-core, never in eval mode). Like dropout, the draw is the same on ranks that share the generator state
and the input shape (tensor-parallel ranks), is replayed by activation recompute (checkpoint restores the
generator) and resumes with the checkpointed RNG state; data-parallel ranks draw the same pattern for their
own tokens, so a data/expert-parallel run equals one process only with jitter off.

Auxiliary losses are attached with ``MoEAuxLossAutoScaler`` (identity forward; backward adds the loss's
gradient scaled by ``main_loss_backward_scale``), so the LM loss the trainer logs stays the LM loss:
- load balancing ('aux_loss'): ``E * coeff / (k * T^2) * sum_i(sum_t p_ti * n_i)`` with p the softmax (or
  normalized sigmoid) scores over all experts and n_i the tokens whose top-k includes expert i;
- z-loss: ``coeff * mean_t(logsumexp(logits_t)^2)``.

The trainer's schedule should call ``set_aux_loss_scale(loss_scale / num_microbatches)`` before the
microbatches (Megatron's schedule does), so the aux-loss gradient averages over microbatches like the LM loss.

Split sequences (context parallel): when a layout gives each of ``size`` ranks an equal share of every
sequence, ``longspan.parallel`` installs a ``SequenceShards`` on each router (``router.sequence_shards``; the
model holds no process group, only the summing callable). The losses are then those of the whole microbatch,
as megatron-core computes them over its tensor × context group: the load-balancing loss uses the token counts
n_i summed over the ranks and T = size × local tokens, with this rank's own scores, so the ranks' values add up
to the one-process loss; the z-loss stays this rank's mean, whose average over the ranks is the whole mean.
Each rank's gradient share is multiplied by ``size`` (megatron-core scales the aux-loss gradient by the
context-parallel size), which the layout's gradient average over data × context parallel brings back to the
one-process gradient. Token dropping (``moe_expert_capacity_factor``) would choose among each rank's own
tokens, a different set than one process's, so ``longspan.parallel.expert_parallel`` refuses it with context
parallel; input jitter draws for each rank's own tokens, as under data parallel (see above).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from longspan.models.args import MoEArgs

# --------------------------------------------------------------------------------------------- aux losses

# The gradient every aux loss receives (``set_aux_loss_scale``); a module-level holder rather than an attribute of
# the autograd.Function class, which compile cannot read.
_AUX_LOSS_SCALE: dict[str, Optional[torch.Tensor]] = {"value": None}


class MoEAuxLossAutoScaler(torch.autograd.Function):
    """Attach an auxiliary loss to an activation: forward returns the activation unchanged; backward also
    sends ``scale`` (``set_aux_loss_scale``'s, via ``attach_aux_loss``) as the aux loss's gradient (so it joins the training objective without
    changing the logged LM loss). Megatron's class of the same name."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, aux_loss: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(aux_loss, scale)
        return output

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        aux_loss, scale = ctx.saved_tensors
        return grad_output, torch.ones_like(aux_loss) * scale, None

    @staticmethod
    def set_loss_scale(scale: torch.Tensor) -> None:
        """Set the gradient the aux losses receive (the main loss's scale / number of microbatches)."""
        _AUX_LOSS_SCALE["value"] = torch.as_tensor(scale, dtype=torch.float32).detach().clone()


def attach_aux_loss(output: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
    """``output`` unchanged, with ``aux_loss`` joining the objective at the scale set for this step. The scale is
    read here rather than in backward (the schedule sets it before the step's forwards), so that compile can
    trace the layer."""
    scale = _AUX_LOSS_SCALE["value"]
    scale = torch.ones((), dtype=torch.float32) if scale is None else scale
    return MoEAuxLossAutoScaler.apply(output, aux_loss, scale.to(aux_loss.device))


def set_aux_loss_scale(scale: float) -> None:
    """The scale the schedule gives every aux loss's gradient: ``loss_scale / num_microbatches`` (1/num
    microbatches without fp16 loss scaling; ``loss_scale`` alone with ``calculate_per_token_loss``)."""
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(float(scale)))


def switch_load_balancing_loss(
    probs: torch.Tensor, tokens_per_expert: torch.Tensor, total_num_tokens: int, topk: int, num_experts: int,
    coeff: float,
) -> torch.Tensor:
    """Switch-transformer load-balancing loss: ``E * coeff / (k * T^2) * sum_i(sum_t probs_ti * n_i)``."""
    aggregated = probs.sum(dim=0)
    return torch.sum(aggregated * tokens_per_expert) * (num_experts * coeff / (topk * total_num_tokens * total_num_tokens))


def z_loss(logits: torch.Tensor, coeff: float) -> torch.Tensor:
    """Router z-loss (ST-MoE): ``coeff * mean_t(logsumexp(logits_t)^2)``."""
    return torch.mean(torch.square(torch.logsumexp(logits, dim=-1))) * coeff


# --------------------------------------------------------------------------------------------- router

@dataclass(frozen=True)
class SequenceShards:
    """The ranks that split every sequence a router sees into equal shares (context parallel): ``size`` of them,
    and ``sum``, which returns a tensor summed over them (a collective; no gradient). Installed on routers by
    ``longspan.parallel.context_parallel``; None on a router that sees whole sequences."""

    size: int
    sum: Callable[[torch.Tensor], torch.Tensor]


def _topk(scores: torch.Tensor, topk: int, num_groups: Optional[int], group_topk: Optional[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k (values, indices) per row; with groups, only within the ``group_topk`` best expert groups (a
    group's score is the sum of its top ``topk // group_topk`` scores), as Megatron's group_limited_topk."""
    if not group_topk:
        return torch.topk(scores, k=topk, dim=1)
    tokens, experts = scores.shape
    group_scores = scores.view(tokens, num_groups, -1).topk(topk // group_topk, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=group_topk, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(tokens, num_groups, experts // num_groups).reshape(tokens, -1)
    return torch.topk(scores.masked_fill(~score_mask.bool(), float("-inf")), k=topk, dim=-1)


def _select(scores: torch.Tensor, moe: MoEArgs,
            expert_bias: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of ``scores``; with an expert bias the choice is made on ``scores + bias`` and the returned values
    are the unbiased scores of the chosen experts (megatron-core's sigmoid path)."""
    if expert_bias is None:
        return _topk(scores, moe.topk, moe.num_groups, moe.group_topk)
    top_idx = _topk(scores + expert_bias, moe.topk, moe.num_groups, moe.group_topk)[1]
    return torch.gather(scores, dim=1, index=top_idx).type_as(scores), top_idx


def updated_expert_bias(tokens_per_expert: torch.Tensor, expert_bias: torch.Tensor, rate: float) -> torch.Tensor:
    """The next expert bias from the step's global token counts (``[..., E]``): raised by ``rate`` for experts
    below the mean count, lowered for those above, unchanged at the mean (megatron-core's
    ``get_updated_expert_bias`` after its all-reduce)."""
    average = tokens_per_expert.sum(dim=-1, keepdim=True) / tokens_per_expert.shape[-1]
    return expert_bias + torch.sign(average - tokens_per_expert) * rate


def in_backward_pass() -> bool:
    """True while autograd runs a backward pass: a forward called then is an activation-recompute replay
    (non-reentrant checkpoint), which must not count its tokens a second time. False while compile traces: a
    compiled region replays its recompute inside the compiled backward, without running this Python again."""
    if torch.compiler.is_compiling():
        return False
    return torch._C._current_graph_task_id() != -1


def expert_capacity(num_tokens: int, topk: int, num_experts: int, capacity_factor: float) -> int:
    """Tokens each expert may take: ``ceil(num_tokens * topk / num_experts * capacity_factor)``."""
    return math.ceil((num_tokens * topk / num_experts) * capacity_factor)


def drop_tokens(
    probs: torch.Tensor, routing_map: torch.Tensor, topk: int, capacity_factor: float, drop_policy: str,
    pad_to_capacity: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep at most ``expert_capacity`` tokens per expert: the highest-probability ones ('probs') or the
    earliest ones ('position'); with ``pad_to_capacity`` every expert gets exactly its capacity (padding
    tokens carry probability 0)."""
    num_tokens, num_experts = probs.shape
    capacity = expert_capacity(num_tokens, topk, num_experts, capacity_factor)
    if capacity > num_tokens:
        keep = torch.ones_like(routing_map)
    elif drop_policy == "probs":
        index = torch.topk(probs, k=capacity, dim=0, sorted=False)[1]
        keep = torch.zeros_like(routing_map).scatter(0, index, True)
    else:  # 'position': the first `capacity` tokens routed to each expert, in token order
        rank = torch.cumsum(routing_map.int(), dim=0)
        keep = routing_map & (rank <= capacity)
        if pad_to_capacity:  # fill each expert up with the earliest tokens not routed to it
            free = torch.cumsum((~routing_map).int(), dim=0)
            need = (capacity - keep.sum(dim=0)).clamp(min=0)
            keep = keep | (~routing_map & (free <= need))
    final_map = keep if pad_to_capacity else routing_map & keep
    return probs * final_map, final_map


class TopKRouter(nn.Module):
    """Linear router (with a bias when ``add_bias_linear``, as Megatron's) followed by top-k selection; attaches the aux and z losses while training.

    ``forward(x [T, hidden])`` returns ``(probs [T, E], routing_map [T, E] bool)``: the routing weight of
    each selected (token, expert) pair, zero elsewhere.
    """

    def __init__(self, hidden_size: int, moe: MoEArgs, init_std: float, dtype: torch.dtype,
                 bias: bool = False) -> None:
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden_size, dtype=dtype))
        self.init_std = init_std  # read by init_weights (Megatron: init_method)
        # A learned logit offset per expert (Megatron: with add_bias_linear; GPT-OSS's router); starts at zero.
        self.bias = nn.Parameter(torch.empty(moe.num_experts, dtype=dtype)) if bias else None
        if moe.expert_bias:
            self.register_buffer("expert_bias", torch.zeros(moe.num_experts, dtype=torch.float32))
        else:
            self.expert_bias: Optional[torch.Tensor] = None
        # Tokens per expert since the last bias update (float32, as Megatron's buffer); None when nothing counted.
        self.local_tokens_per_expert: Optional[torch.Tensor] = None
        # Set by the context-parallel plan when this router sees a share of each sequence (see the module docstring).
        self.sequence_shards: Optional[SequenceShards] = None

    def _apply(self, fn: Callable[..., Any], recurse: bool = True) -> "TopKRouter":
        was_meta = self.expert_bias is not None and self.expert_bias.is_meta
        super()._apply(fn, recurse)
        bias = self.expert_bias
        if bias is not None and not bias.is_meta:
            if was_meta:  # to_empty() materializing a meta-built model: the bias starts at zero, as in Megatron
                bias.zero_()
            if bias.dtype != torch.float32:  # kept in float32 under model.to(bf16), as Megatron does
                self.expert_bias = bias.float()
        return self

    def count_tokens(self, routing_map: torch.Tensor) -> None:
        """Add ``routing_map``'s tokens per expert to the counts the next bias update uses (training forwards
        only: grad enabled and not an activation-recompute replay, as megatron-core counts)."""
        if self.expert_bias is None or not torch.is_grad_enabled() or in_backward_pass():
            return
        counts = routing_map.sum(dim=0).to(torch.float32)
        previous = self.local_tokens_per_expert
        self.local_tokens_per_expert = counts if previous is None else previous + counts

    def take_token_counts(self) -> torch.Tensor:
        """The counts since the last call (zeros when none), and reset them."""
        counts = self.local_tokens_per_expert
        self.local_tokens_per_expert = None
        if counts is None:
            return torch.zeros(self.moe.num_experts, dtype=torch.float32, device=self.expert_bias.device)
        return counts.to(self.expert_bias.device)

    def routed_rows(self, num_tokens: int) -> tuple[int, bool]:
        """How many (token, expert) pairs the routing map of ``num_tokens`` tokens holds, and whether that is
        exact (True) or a bound (False: token dropping without padding keeps a data-dependent number). Lets the
        dispatcher permute with a static row count, without reading the map on the host."""
        moe = self.moe
        routed = num_tokens * moe.topk
        if moe.capacity_factor is None:
            return routed, True
        capacity = expert_capacity(num_tokens, moe.topk, moe.num_experts, moe.capacity_factor)
        if moe.pad_to_capacity:  # every expert takes exactly its capacity (all tokens when that exceeds them)
            return moe.num_experts * min(capacity, num_tokens), True
        if capacity > num_tokens:
            return routed, True
        return min(routed, moe.num_experts * capacity), False

    def jitter(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` times noise uniform in [1 - eps, 1 + eps] while training (``moe_input_jitter_eps``); the draw
        is megatron-core's (``Uniform(1 - eps, 1 + eps).rsample`` in x's dtype on torch's global generator)."""
        eps = self.moe.input_jitter_eps
        if not eps or not self.training:
            return x
        low = torch.tensor(1.0 - eps, dtype=x.dtype, device=x.device)
        high = torch.tensor(1.0 + eps, dtype=x.dtype, device=x.device)
        return x * (low + torch.rand(x.shape, dtype=x.dtype, device=x.device) * (high - low))

    def gating(self, x: torch.Tensor) -> torch.Tensor:
        """Router logits ``[T, E]``, in ``moe_router_dtype`` when set."""
        dtype = self.moe.router_dtype
        bias = self.bias
        if dtype is not None:
            return F.linear(x.to(dtype), self.weight.to(dtype), None if bias is None else bias.to(dtype))
        return F.linear(x, self.weight, bias)

    def routing(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """Top-k routing of ``logits``; returns probs, routing map and the unscaled losses for logging."""
        moe = self.moe
        tracked: dict[str, torch.Tensor] = {}
        attach = self.training and torch.is_grad_enabled()
        shards = self.sequence_shards
        num_shards = 1 if shards is None else shards.size
        num_tokens = logits.shape[0]
        # With calculate_per_token_loss the trainer divides every gradient by the global token count afterwards;
        # scaling by the microbatch's token count keeps the aux losses averaged per microbatch (as Megatron does).
        token_scale = num_tokens * num_shards if moe.calculate_per_token_loss else 1
        if moe.z_loss_coeff is not None and attach:
            loss = z_loss(logits, moe.z_loss_coeff)
            logits = attach_aux_loss(logits, loss * token_scale)
            tracked["z_loss"] = loss.detach() / moe.z_loss_coeff
        if moe.score_function == "softmax":
            if moe.pre_softmax:
                scores = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
                top_probs, top_idx = _topk(scores, moe.topk, moe.num_groups, moe.group_topk)
            else:
                top_logits, top_idx = _topk(logits, moe.topk, moe.num_groups, moe.group_topk)
                top_probs = torch.softmax(top_logits, dim=-1, dtype=torch.float32).type_as(logits)
        else:  # sigmoid scores (chosen with the expert bias), normalized over the selected experts when topk > 1
            scores = torch.sigmoid(logits.float()).type_as(logits)
            top_probs, top_idx = _select(scores, moe, self.expert_bias)
            if moe.topk > 1:
                top_probs = top_probs / (top_probs.sum(dim=-1, keepdim=True) + 1e-20)
        if moe.topk_scaling_factor:
            top_probs = top_probs * moe.topk_scaling_factor
        probs = torch.zeros_like(logits).scatter(1, top_idx, top_probs)
        routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top_idx, True)
        if moe.capacity_factor is not None:
            probs, routing_map = drop_tokens(probs, routing_map, moe.topk, moe.capacity_factor, moe.drop_policy,
                                             moe.pad_to_capacity)
        if moe.aux_loss_coeff > 0 and attach:
            # Scores over all experts and the top-k before dropping, as Megatron's
            # compute_routing_scores_for_aux_loss.
            if moe.score_function == "softmax":
                aux_scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
            else:
                aux_scores = torch.sigmoid(logits)
                aux_scores = aux_scores / (aux_scores.sum(dim=-1, keepdim=True) + 1e-20)
            aux_idx = torch.topk(aux_scores, k=moe.topk, dim=1)[1]
            aux_map = torch.zeros_like(aux_scores).scatter(1, aux_idx, 1.0)
            counts = aux_map.sum(dim=0)
            if shards is not None:  # the whole sequence's counts; this rank's share of the loss (docstring)
                counts = shards.sum(counts)
            loss = switch_load_balancing_loss(aux_scores, counts, num_tokens * num_shards, moe.topk,
                                              moe.num_experts, moe.aux_loss_coeff) * num_shards
            probs = attach_aux_loss(probs, loss * token_scale)
            tracked["load_balancing_loss"] = loss.detach() / moe.aux_loss_coeff
        self.count_tokens(routing_map)
        return probs, routing_map, tracked

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs, routing_map, tracked = self.routing(self.gating(self.jitter(x)))
        self.last_tracked = tracked
        return probs, routing_map
