"""Expert parallel: MoE expert weights sharded over the ``ep`` (and ``etp``) mesh, tokens moved by all-to-all.

Applied from the outside to a plain model (``longspan.models.moe``), after tensor parallel and before data
parallel (``longspan.parallel.parallelize``):

- Expert weights (``mlp.experts.linear_fc1/linear_fc1_gate/linear_fc2``, ``[E, out, in]``) become DTensors:
  ``Shard(0)`` over ``ep`` (rank r holds experts ``[r*E/ep, (r+1)*E/ep)``; no rank holds all experts) and,
  with expert tensor parallel, fc1/gate split along the ffn width (``Shard(1)``) and fc2 along its input
  (``Shard(2)``) over ``etp``. ``init_weights`` draws each full slab from (seed, name) and every rank keeps its
  slice, so every layout starts from the same experts.
- Each MoE layer's ``token_dispatcher`` becomes an ``AllToAllTokenDispatcher``: tokens routed on their home
  rank (the router and its top-k, capacity dropping and aux losses run on the tokens this rank holds, exactly
  as on one process) are permuted by expert, exchanged with ``all_to_all_single`` over the ep group, run
  through the local experts, sent back, weighted by their routing probabilities and summed per token on
  the home rank. With etp > 1 the ranks of an etp group hold the same tokens (etp = tp, no sequence
  parallel); each computes a partial fc2 output from its ffn slice and the partial sums are all-reduced.
  The per-expert counts stay on the device except for the all-to-all split sizes, which ``all_to_all_single``
  takes as Python lists (the one host read of the step); the received rows are put in expert order by a
  stable device sort.
- Shared experts are split like the dense MLP over ``tp`` (fc1/gate column-wise, fc2 row-wise); the router
  and the shared-expert gate stay replicated.
- Latent projections (``moe_latent_size``) are split along the latent over ``tp``: ``fc1_latent_proj``
  column-wise with its output all-gathered (the experts read the whole latent), ``fc2_latent_proj`` row-wise
  on its replicated input with its partial sums all-reduced; so tp must divide the latent size.
- Sequence parallel: the tensor-parallel plan gathers every MLP's input from its sequence shards, so an MoE
  layer routes the whole sequence on every tp rank exactly as without sequence parallel (its aux losses
  included); its replicated output is then cut back to this rank's sequence shard (no communication; the
  backward all-gathers the gradient), where the residual stream expects it.
- Gradients: expert weights are left out of the data-parallel wrappers (DDP ignores them; FSDP2 never sees
  them). The experts' ``weight_fn`` (``ExpertWeight``) routes each weight's gradient through a function that
  scales every contribution by 1/(dp × cp) and sums it over the expert-data-parallel group, which with the ep
  all-to-all makes the average over all data-parallel ranks (Megatron's ``expert_gradient_scaling_factor``);
  it reduces on every microbatch (no ``no_sync`` deferral). Dense parameters are averaged by the wrappers.

Aux-loss-free routing: ``update_expert_biases`` (called once per optimizer step by the trainer) sums every MoE
layer's token counts over the data-parallel × context-parallel group (the ranks that together hold the global
batch; tensor-parallel ranks hold the same tokens and expert-parallel ranks are data-parallel ranks here), so
every rank applies the same update to the same bias: the one a single process computes from the whole batch.

Context parallel: MoE layers are token-wise, so each rank routes the tokens of its sequence chunks; the
expert-parallel group is carved out of the data × context-parallel ranks (``longspan.parallel.mesh``: the expert
mesh has no cp dimension), the expert gradients are averaged over data × context parallel as above, and the
bias counts summed over it. The aux losses see the whole sequence through the ``SequenceShards`` the
context-parallel plan installs on every router (``longspan.models.moe``).

Supported layouts: expert_tensor_parallel_size equal to tensor_model_parallel_size (its default), and no
token dropping (``moe_expert_capacity_factor``) with context parallel (each raises NotSupportedError naming the
field).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleOutput,
    RowwiseParallel,
    parallelize_module,
)
from torch.nn.parallel import DistributedDataParallel

from longspan.core.errors import ConfigError, NotSupportedError
from longspan.core.logging import get_logger
from longspan.models.local import local_tensor
from longspan.models.moe import GroupedMLP, MoELayer, moe_layers
from longspan.models.moe_router import updated_expert_bias
from longspan.models.moe_dispatch import pad_rows, permute, unpermute
from longspan.parallel.collectives import copy_to_group, reduce_from_group

_log = get_logger(__name__)

# --------------------------------------------------------------------------------------------- autograd comms

class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` along dim 0 with uneven splits; backward sends the gradients back."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: Any) -> torch.Tensor:
        ctx.output_splits, ctx.input_splits, ctx.group = output_splits, input_splits, group
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        out = grad.new_empty((sum(ctx.input_splits), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), ctx.input_splits, ctx.output_splits, group=ctx.group)
        return out, None, None, None


# --------------------------------------------------------------------------------------------- dispatcher

class AllToAllTokenDispatcher:
    """Token dispatch over the expert-parallel group (see the module docstring).

    Args:
        num_experts: experts per MoE layer (global).
        ep_group: the expert-parallel process group (None when ep == 1).
        ep_size: its size; this rank holds experts ``[ep_rank * E/ep, (ep_rank + 1) * E/ep)``.
        etp_group: the expert tensor-parallel group when etp > 1, else None.
    """

    def __init__(self, num_experts: int, ep_group: Any, ep_size: int, etp_group: Any = None) -> None:
        if num_experts % ep_size:
            raise ConfigError(
                f"model.num_moe_experts={num_experts} is not divisible by model.expert_model_parallel_size={ep_size}"
            )
        self.num_experts = num_experts
        self.ep_group = ep_group
        self.ep_size = ep_size
        self.local_experts = num_experts // ep_size
        self.etp_group = etp_group

    def _run_experts(self, x: torch.Tensor, counts: torch.Tensor, experts: GroupedMLP) -> torch.Tensor:
        if self.etp_group is None:
            return experts(x, counts)
        x = copy_to_group(x, self.etp_group)
        y = reduce_from_group(experts(x, counts, add_output_bias=False), self.etp_group)
        bias = experts.output_bias(counts, x.shape[0])
        return y if bias is None else y + bias

    def dispatch_and_combine(self, x: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor,
                             experts: GroupedMLP, rows: Optional[tuple[int, bool]] = None) -> torch.Tensor:
        """Expert outputs for this rank's tokens ``x [T, h]``, weighted by ``probs`` and summed per token.
        ``rows``: the routed row count (``longspan.models.moe.permute``)."""
        permuted, permutation = permute(x, routing_map, rows)
        counts = permutation.tokens_per_expert
        if self.ep_size == 1:
            y = self._run_experts(permuted, counts, experts)
            return unpermute(y, probs, permutation, x.shape[0])
        ep, local = self.ep_size, self.local_experts
        send = counts.view(ep, local)  # [dest rank, its local expert]
        recv = torch.empty_like(send)  # [source rank, my local expert]
        dist.all_to_all_single(recv, send, group=self.ep_group)
        # The one host read of the step: all_to_all_single takes its split sizes as Python lists.
        input_splits, output_splits = send.sum(dim=1).tolist(), recv.sum(dim=1).tolist()
        received = _AllToAll.apply(permuted[:sum(input_splits)], output_splits, input_splits, self.ep_group)

        # Received rows come source-major (source rank, then expert); the experts want expert-major: a stable
        # sort of the rows by local expert, on the device.
        local_expert = torch.arange(ep * local, device=recv.device) % local
        row_expert = torch.repeat_interleave(local_expert, recv.flatten(), output_size=received.shape[0])
        order = torch.argsort(row_expert, stable=True)
        y = self._run_experts(received.index_select(0, order), recv.sum(dim=0), experts)
        y_src_major = y.index_select(0, torch.argsort(order))
        back = _AllToAll.apply(y_src_major, input_splits, output_splits, self.ep_group)
        return unpermute(pad_rows(back, permuted.shape[0]), probs, permutation, x.shape[0])


# --------------------------------------------------------------------------------------------- sharding

def _expert_placements(name: str, ep: int, etp: int) -> list[Any]:
    """DTensor placements of an expert parameter (``linear_fc1.weight`` ...) over the mesh dims in use."""
    placements: list[Any] = []
    if ep > 1:
        placements.append(Shard(0))
    if etp > 1:
        module, param = name.split(".")
        if module == "linear_fc2":
            placements.append(Shard(2) if param == "weight" else Replicate())
        else:
            placements.append(Shard(1))
    return placements


def _expert_mesh(parallel: Any, ep: int, etp: int) -> Any:
    if ep > 1 and etp > 1:
        return parallel.expert_mesh["ep", "etp"]
    return parallel.submesh("ep" if ep > 1 else "etp")


def check_expert_parallel(model: nn.Module, parallel: Any) -> None:
    """Raise (one line) when the MoE layers of ``model`` cannot run on ``parallel``'s layout."""
    layers = moe_layers(model)
    if not layers:
        return
    ep, etp, tp, cp = parallel.ep_size, parallel.etp_size, parallel.tp_size, parallel.cp_size
    if etp != tp:
        raise NotSupportedError(
            f"model.expert_tensor_parallel_size={etp} differs from model.tensor_model_parallel_size={tp}: "
            "longspan's expert parallel needs them equal (leave expert_tensor_parallel_size unset)"
        )
    capacity = layers[0].router.moe.capacity_factor
    if cp > 1 and capacity is not None:
        raise NotSupportedError(
            f"model.moe_expert_capacity_factor={capacity} with model.context_parallel_size={cp} is not supported: "
            "each rank would drop among its own sequence chunks, unlike one process; "
            "use moe_expert_capacity_factor=None"
        )
    experts = layers[0].num_experts
    if experts % ep:
        raise ConfigError(
            f"model.num_moe_experts={experts} is not divisible by model.expert_model_parallel_size={ep}"
        )
    ffn = layers[0].experts.linear_fc1.weight.shape[1]
    if ffn % etp:
        raise ConfigError(
            f"model.moe_ffn_hidden_size={ffn} is not divisible by expert_tensor_parallel_size={etp}"
        )
    latent = layers[0].fc1_latent_proj
    if latent is not None and latent.out_features % tp:
        raise ConfigError(
            f"model.moe_latent_size={latent.out_features} is not divisible by model.tensor_model_parallel_size={tp}: "
            "tensor parallel splits the MoE latent projections along the latent"
        )
    shared = layers[0].shared_experts
    if shared is not None and shared.linear_fc1.out_features % tp:
        raise ConfigError(
            f"model.moe_shared_expert_intermediate_size={shared.linear_fc1.out_features} is not divisible by "
            f"tensor_model_parallel_size={tp}"
        )


class _ExpertGradReduce(torch.autograd.Function):
    """Identity forward on an expert weight's local shard; backward scales the gradient by ``scale`` and sums
    it over the expert-data-parallel group (when there is one)."""

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor, scale: float, edp_group: Any) -> torch.Tensor:
        ctx.scale, ctx.edp_group = scale, edp_group
        return w.view_as(w)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        grad = grad * ctx.scale
        if ctx.edp_group is not None:
            dist.all_reduce(grad, group=ctx.edp_group)
        return grad, None, None


class ExpertWeight:
    """``GroupedMLP.weight_fn`` under expert parallel: the parameter's local shard, whose gradient is scaled by
    1/(dp × cp) and summed over the expert-data-parallel group (see the module docstring). Lives on the module,
    not as a hook on the parameter, so it survives ``to_empty`` replacing parameter storage."""

    def __init__(self, scale: float, edp_group: Any) -> None:
        self.scale = scale
        self.edp_group = edp_group

    def __call__(self, param: torch.Tensor) -> torch.Tensor:
        return _ExpertGradReduce.apply(local_tensor(param), self.scale, self.edp_group)


def apply_expert_parallel(model: nn.Module, parallel: Any, sequence_parallel: bool = False) -> list[nn.Parameter]:
    """Shard the experts of every MoE layer of ``model`` (meta or materialized) and install the all-to-all
    dispatcher; return the expert parameters, which the data-parallel wrappers must leave alone.

    Nothing happens (and ``[]`` is returned) without MoE layers or when ep == etp == 1: the experts are then
    ordinary replicated parameters. Call after tensor parallel, before data parallel, then ``init_weights``.
    """
    layers = moe_layers(model)
    if not layers:
        return []
    check_expert_parallel(model, parallel)
    ep, etp, tp = parallel.ep_size, parallel.etp_size, parallel.tp_size
    if tp > 1:
        _shard_shared_experts(layers, parallel.submesh("tp"))
        _shard_latent_projections(layers, parallel.submesh("tp"))
        if sequence_parallel:
            _return_sequence_shards(layers, parallel.submesh("tp"))
    if ep == 1 and etp == 1:
        return []

    mesh = _expert_mesh(parallel, ep, etp)
    etp_group = parallel.etp_group if etp > 1 else None
    ep_group = parallel.ep_group if ep > 1 else None
    edp_size = parallel.edp_size
    edp_group = parallel.edp_group if edp_size > 1 else None
    scale = 1.0 / parallel.size("dp_cp")
    params: list[nn.Parameter] = []
    for layer in layers:
        if etp > 1 and any(".adapter." in n for n, _ in layer.experts.named_parameters()):
            raise NotSupportedError(
                f"adapters on routed experts with expert_tensor_parallel_size={etp} are not supported yet: exclude "
                "the experts (peft.exclude_modules=['*.experts.*']) or use expert_tensor_parallel_size=1"
            )
        for name, param in list(layer.experts.named_parameters()):
            # ``linear_fc1.weight``, or an adapter's ``linear_fc1.adapter.linear_in.weight`` (longspan.peft):
            # every expert parameter is [num_experts, ...] and shards by expert.
            module_name, _, param_name = name.rpartition(".")
            module = layer.experts.get_submodule(module_name)
            placements = _expert_placements(name, ep, etp)
            sharded = nn.Parameter(distribute_tensor(param.data, mesh, placements, src_data_rank=None),
                                   requires_grad=param.requires_grad)
            module.register_parameter(param_name, sharded)
            params.append(sharded)
        layer.experts.weight_fn = ExpertWeight(scale, edp_group)
        layer.token_dispatcher = AllToAllTokenDispatcher(layer.num_experts, ep_group, ep, etp_group)
    _log.debug("expert parallel: ep=%d etp=%d edp=%d over %d MoE layers", ep, etp, edp_size, len(layers))
    return params


def _shard_shared_experts(layers: list[MoELayer], tp_mesh: Any) -> None:
    """Split shared experts like the dense MLP over ``tp``: fc1/gate column-wise, fc2 row-wise."""
    for layer in layers:
        shared = layer.shared_experts
        if shared is None:
            continue
        plan: dict[str, Any] = {"linear_fc1": ColwiseParallel(), "linear_fc2": RowwiseParallel()}
        if shared.linear_fc1_gate is not None:
            plan["linear_fc1_gate"] = ColwiseParallel()
        for name, style in plan.items():  # an adapted layer (longspan.peft) places its adapter with its base
            adapt = getattr(getattr(shared, name), "adapt_parallel_style", None)
            if adapt is not None:
                plan[name] = adapt(style)
        parallelize_module(shared, tp_mesh, plan)


def _shard_latent_projections(layers: list[MoELayer], tp_mesh: Any) -> None:
    """Split the latent projections along the latent over ``tp`` (see the module docstring): each rank computes
    its share of the latent, gathered whole for the experts; the way back sums each rank's share."""
    for layer in layers:
        if layer.fc1_latent_proj is None:
            continue
        plan: dict[str, Any] = {"fc1_latent_proj": ColwiseParallel(output_layouts=Replicate()),
                                "fc2_latent_proj": RowwiseParallel(input_layouts=Replicate())}
        for name, style in plan.items():  # an adapted layer (longspan.peft) places its adapter with its base
            adapt = getattr(getattr(layer, name), "adapt_parallel_style", None)
            if adapt is not None:
                plan[name] = adapt(style)
        parallelize_module(layer, tp_mesh, plan)


def _return_sequence_shards(layers: list[MoELayer], tp_mesh: Any) -> None:
    """Under sequence parallel: each MoE layer's replicated output cut to this rank's sequence shard (its input
    is gathered by the tensor-parallel plan's ``PrepareModuleInput`` on every ``mlp``)."""
    for layer in layers:
        parallelize_module(layer, tp_mesh, PrepareModuleOutput(
            output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=True))


def expert_parameter_names(model: nn.Module, params: list[nn.Parameter]) -> list[str]:
    """Fully qualified names in ``model`` of ``params`` (for DDP's ignore list)."""
    wanted = {id(p) for p in params}
    return [name for name, p in model.named_parameters() if id(p) in wanted]


def ignore_in_ddp(model: nn.Module, params: list[nn.Parameter]) -> None:
    """Make a later ``DistributedDataParallel(model)`` skip ``params`` (expert weights are reduced here)."""
    names = expert_parameter_names(model, params)
    if names:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)


@contextlib.contextmanager
def hidden_parameters(model: nn.Module, params: list[nn.Parameter]) -> Iterator[None]:
    """Temporarily unregister ``params`` from their modules, so a wrapper built inside (FSDP2's
    ``fully_shard``) does not take them over (the effect of its ``ignored_params``); restored on exit."""
    wanted = {id(p) for p in params}
    removed: list[tuple[nn.Module, str, nn.Parameter]] = []
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and id(param) in wanted:
                removed.append((module, name, param))
                del module._parameters[name]
    try:
        yield
    finally:
        for module, name, param in removed:
            module.register_parameter(name, param)


# --------------------------------------------------------------------------------------------- expert bias

@torch.no_grad()
def update_expert_biases(model: nn.Module | list[nn.Module], parallel: Any = None) -> None:
    """Once per optimizer step: move every MoE layer's ``expert_bias`` by ``moe_router_bias_update_rate *
    sign(mean - count)`` from the tokens per expert counted over the step's microbatches, summed over the
    ``dp_cp`` group of ``parallel`` (None: one process), and reset the counts. Nothing happens for models
    without expert bias. Collective over that group when it has several ranks."""
    routers = [layer.router for layer in moe_layers(model) if layer.router.expert_bias is not None]
    if not routers:
        return
    counts = torch.stack([router.take_token_counts() for router in routers])  # [layers, experts] float32
    if parallel is not None and parallel.size("dp_cp") > 1:
        dist.all_reduce(counts, group=parallel.dp_cp_group)
    for router, layer_counts in zip(routers, counts):
        router.expert_bias.copy_(updated_expert_bias(layer_counts, router.expert_bias, router.moe.bias_update_rate))
