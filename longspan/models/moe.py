"""Mixture of experts for the GPT model: experts, shared experts, the MoE layer (its router and aux/z losses:
``longspan.models.moe_router``).

Megatron Core semantics in plain PyTorch (no process groups here; expert parallelism is applied from
outside by ``longspan.parallel.expert_parallel``, which swaps the layer's ``token_dispatcher`` and shards
the expert weights). Module and parameter names follow Megatron::

    decoder.layers.{i}.mlp.router.weight                          [num_experts, hidden]
    decoder.layers.{i}.mlp.router.bias                            [num_experts]  (add_bias_linear)
    decoder.layers.{i}.mlp.experts.linear_fc1.weight              [num_experts, moe_ffn, hidden]  (up)
    decoder.layers.{i}.mlp.experts.linear_fc1_gate.weight         [num_experts, moe_ffn, hidden]  (gated only)
    decoder.layers.{i}.mlp.experts.linear_fc2.weight              [num_experts, hidden, moe_ffn]  (down)
    decoder.layers.{i}.mlp.shared_experts.linear_fc1 / linear_fc1_gate / linear_fc2   nn.Linear
    decoder.layers.{i}.mlp.shared_experts.gate_weight             [1, hidden]  (moe_shared_expert_gate)
    decoder.layers.{i}.mlp.fc1_latent_proj / fc2_latent_proj      nn.Linear hidden <-> latent  (moe_latent_size)

With ``moe_latent_size`` the routed experts work in a latent space (Megatron's MoELayer): the router and the
shared experts read the hidden state, the experts read ``fc1_latent_proj(x)`` and their combined output goes
through ``fc2_latent_proj`` before the shared experts' output is added; the experts' ``hidden`` above is then the
latent width.

Expert weights are 3-D parameters (one slab per expert) so expert parallel is a ``Shard(0)`` DTensor over the
ep mesh and ``init_weights`` draws the full slab from (seed, name) under every layout.

The experts (``GroupedMLP``) run as one grouped GEMM per projection with ``moe_grouped_gemm``
(``longspan.models.grouped_gemm``; where the kernel cannot serve, a warning names the reason and the expert loop
runs), else expert by expert, the reference. Nothing in a step reads a tensor on the host on the grouped path:
tokens are permuted on the device (``longspan.models.moe_dispatch``, with the row count the router knows from
its settings), the counts become int32 offsets, and the router, its expert bias, group-limited top-k, token
dropping, aux and z losses and the metrics are tensor operations; so ``torch.compile`` traces the layer as one
graph. The expert loop reads the counts (``split_by_expert``); under expert parallel the all-to-all split sizes
are read (``longspan.parallel.expert_parallel``).

Each MoE layer accumulates its own metrics while training (load-balancing loss and z-loss without their
coefficients, tokens per expert); ``moe_layer_metrics`` reads them and ``reset_moe_metrics`` clears them. With
split sequences each rank tracks ``size`` × its share of the load-balancing loss, its own z-loss mean and its
own token counts, so the log's average (sum for counts) over the data × context ranks is the whole batch's.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from longspan.core.logging import get_logger
from longspan.models.activations import gated_activation
from longspan.models.args import MoEArgs, TransformerArgs
from longspan.models.grouped_gemm import grouped_gemm_unsupported, grouped_linear, rows_expert
from longspan.models.local import local_tensor
from longspan.models.moe_dispatch import pad_rows, permute, split_by_expert, unpermute
from longspan.models.moe_router import TopKRouter, in_backward_pass

_log = get_logger(__name__)

# --------------------------------------------------------------------------------------------- experts

class GroupedLinear(nn.Module):
    """``num_experts`` independent linear maps stored as one ``weight [E, out, in]`` (and ``bias [E, out]``).

    Not called directly: ``GroupedMLP`` applies expert e's slab to the rows routed to expert e.
    """

    def __init__(self, num_experts: int, in_features: int, out_features: int, bias: bool, init_std: float,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(num_experts, out_features, dtype=dtype)) if bias else None
        self.init_std = init_std  # read by init_weights

    def extra_repr(self) -> str:
        e, out, inp = self.weight.shape
        return f"experts={e}, in_features={inp}, out_features={out}, bias={self.bias is not None}"


class GroupedMLP(nn.Module):
    """The routed experts: each a dense MLP (gated or not) of width ``moe_ffn_hidden_size``.

    ``forward(x, tokens_per_expert)`` takes rows grouped by expert (``tokens_per_expert[j]`` rows for the
    j-th expert this process holds, in order; a device tensor) and returns their outputs in the same order;
    rows past the counted ones (padding after token dropping) give zeros. Under expert parallel the weights
    are DTensors and this process holds a contiguous block of experts (and, with expert tensor parallel, a
    slice of each expert's ffn width); the computation uses the local shards.

    With ``grouped_gemm`` (``moe_grouped_gemm``) each projection is one grouped matrix product over all local
    experts (``longspan.models.grouped_gemm``); the counts stay on the device. Without it, or where the
    kernel cannot serve (a warning names the reason and the path taken), the experts run one after the
    other, which reads the counts on the host: the reference path.
    """

    def __init__(self, config: TransformerArgs, moe: MoEArgs) -> None:
        super().__init__()
        std = config.init_method_std
        out_std = std / math.sqrt(2.0 * config.num_layers)
        dtype, bias, ffn, e = config.params_dtype, config.add_bias_linear, moe.ffn_hidden_size, moe.num_experts
        h = moe.latent_size or config.hidden_size  # the experts' input and output width
        self.num_experts = e
        self.linear_fc1 = GroupedLinear(e, h, ffn, bias, std, dtype)
        self.linear_fc1_gate = GroupedLinear(e, h, ffn, bias, std, dtype) if config.gated_linear_unit else None
        self.linear_fc2 = GroupedLinear(e, ffn, h, bias, out_std, dtype)
        self.activation_func: Callable[[torch.Tensor], torch.Tensor] = config.activation_func
        self.glu_linear_offset = float(config.glu_linear_offset)
        self.activation_func_clamp_value = config.activation_func_clamp_value
        self.grouped_gemm = moe.grouped_gemm
        # How a parameter becomes the tensor the computation uses: its local shard. Expert parallel installs
        # a version that also routes the gradient through its expert-data-parallel reduction.
        self.weight_fn: Callable[[torch.Tensor], torch.Tensor] = local_tensor

    def _weights(self, add_output_bias: bool) -> tuple[Optional[torch.Tensor], ...]:
        """(w1, wg, w2, b1, bg, b2): the local shards the computation uses (None where absent)."""
        fn = self.weight_fn
        gate = self.linear_fc1_gate
        wg = fn(gate.weight) if gate is not None else None
        b1 = fn(self.linear_fc1.bias) if self.linear_fc1.bias is not None else None
        bg = fn(gate.bias) if gate is not None and gate.bias is not None else None
        b2 = fn(self.linear_fc2.bias) if self.linear_fc2.bias is not None and add_output_bias else None
        return fn(self.linear_fc1.weight), wg, fn(self.linear_fc2.weight), b1, bg, b2

    def _hidden(self, up: torch.Tensor, gate: Optional[torch.Tensor]) -> torch.Tensor:
        if gate is None:
            return self.activation_func(up)
        return gated_activation(gate, up, self.activation_func, self.glu_linear_offset,
                                self.activation_func_clamp_value)

    def uses_grouped_gemm(self, x: torch.Tensor) -> bool:
        """Whether ``forward`` on rows like ``x`` runs the grouped kernel; logs why not when it was asked for."""
        if not self.grouped_gemm:
            return False
        w1 = self.linear_fc1.weight
        reason = grouped_gemm_unsupported(x.dtype, x.device, (w1.shape[-1], local_tensor(w1).shape[1]))
        if reason is not None:
            _warn_sequential(reason)
        return reason is None

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor, add_output_bias: bool = True) -> torch.Tensor:
        w1, wg, w2, b1, bg, b2 = self._weights(add_output_bias)
        if tokens_per_expert.shape[0] != w1.shape[0]:
            raise RuntimeError(f"GroupedMLP: {tokens_per_expert.shape[0]} token counts for {w1.shape[0]} local experts")
        if not self.uses_grouped_gemm(x):
            return self._sequential(x, tokens_per_expert, w1, wg, w2, b1, bg, b2)
        offsets = torch.cumsum(tokens_per_expert, dim=0).to(torch.int32)
        row_expert = rows_expert(offsets, x.shape[0]) if b1 is not None or b2 is not None else None

        def project(rows: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor]) -> torch.Tensor:
            out = grouped_linear(rows, w, offsets)
            return out if b is None else out + _row_bias(b, row_expert)

        up = project(x, w1, b1)
        h = self._hidden(up, project(x, wg, bg) if wg is not None else None)
        return project(h, w2, b2)

    def _sequential(self, x: torch.Tensor, tokens_per_expert: torch.Tensor, w1: torch.Tensor,
                    wg: Optional[torch.Tensor], w2: torch.Tensor, b1: Optional[torch.Tensor],
                    bg: Optional[torch.Tensor], b2: Optional[torch.Tensor]) -> torch.Tensor:
        """One expert at a time (the counts read on the host).

        The weights are unbound once rather than indexed per expert: the backward of ``w[j]`` writes each
        expert's gradient into a zero tensor of all experts' size, E of them per projection (quadratic in the
        experts), where ``unbind``'s backward stacks the E slices once; the sums are the same."""
        w1, wg, w2, b1, bg, b2 = (None if t is None else t.unbind(0) for t in (w1, wg, w2, b1, bg, b2))
        outputs = []
        for j, rows in enumerate(split_by_expert(x, tokens_per_expert)):
            up = F.linear(rows, w1[j], None if b1 is None else b1[j])
            gate = F.linear(rows, wg[j], None if bg is None else bg[j]) if wg is not None else None
            outputs.append(F.linear(self._hidden(up, gate), w2[j], None if b2 is None else b2[j]))
        return pad_rows(torch.cat(outputs, dim=0) if outputs else x.new_zeros(0, w2.shape[1]), x.shape[0])

    def output_bias(self, tokens_per_expert: torch.Tensor, num_rows: int) -> Optional[torch.Tensor]:
        """The fc2 bias row of each of ``num_rows`` output rows (zero for padding rows), for callers that add it
        after a partial-sum reduction."""
        if self.linear_fc2.bias is None:
            return None
        offsets = torch.cumsum(tokens_per_expert, dim=0).to(torch.int32)
        return _row_bias(self.weight_fn(self.linear_fc2.bias), rows_expert(offsets, num_rows))


_WARNED: set[str] = set()


def _warn_sequential(reason: str) -> None:
    """Say once per reason that the experts run one at a time although grouped GEMMs were asked for."""
    if reason not in _WARNED:
        _WARNED.add(reason)
        _log.warning("moe_grouped_gemm=True but %s: the experts run one at a time (sequential path)", reason)


def _row_bias(bias: torch.Tensor, row_expert: torch.Tensor) -> torch.Tensor:
    """``bias [E, out]`` picked per row by ``row_expert`` (index E, a padding row, picks zeros)."""
    return torch.cat([bias, bias.new_zeros(1, bias.shape[1])]).index_select(0, row_expert)




class SharedExpertMLP(nn.Module):
    """Experts every token goes through (a dense MLP of width ``moe_shared_expert_intermediate_size``),
    optionally scaled by ``sigmoid(x @ gate_weight^T)`` per token (``moe_shared_expert_gate``)."""

    def __init__(self, config: TransformerArgs, moe: MoEArgs) -> None:
        super().__init__()
        std = config.init_method_std
        out_std = std / math.sqrt(2.0 * config.num_layers)
        dtype, bias, h, ffn = config.params_dtype, config.add_bias_linear, config.hidden_size, moe.shared_ffn_hidden_size
        self.linear_fc1 = _linear(h, ffn, bias, std, dtype)
        self.linear_fc1_gate = _linear(h, ffn, bias, std, dtype) if config.gated_linear_unit else None
        self.linear_fc2 = _linear(ffn, h, bias, out_std, dtype)
        self.activation_func = config.activation_func
        self.gate_weight = nn.Parameter(torch.empty(1, h, dtype=dtype)) if moe.shared_expert_gate else None
        self.init_std = std  # gate_weight ~ normal(0, init_method_std), as Megatron's init_method

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up = self.linear_fc1(x)
        if self.linear_fc1_gate is not None:
            h = self.activation_func(self.linear_fc1_gate(x)) * up
        else:
            h = self.activation_func(up)
        out = self.linear_fc2(h)
        if self.gate_weight is not None:
            out = out * torch.sigmoid(F.linear(x, self.gate_weight))
        return out


def _linear(in_features: int, out_features: int, bias: bool, std: float, dtype: torch.dtype) -> nn.Linear:
    layer = nn.Linear(in_features, out_features, bias=bias, dtype=dtype)
    layer.init_std = std  # read by init_weights
    return layer


# --------------------------------------------------------------------------------------------- dispatch

class LocalTokenDispatcher:
    """All experts on this process: permute, run the experts, weight and sum back. Expert parallel replaces
    a layer's dispatcher with ``longspan.parallel.expert_parallel.AllToAllTokenDispatcher``."""

    def dispatch_and_combine(self, x: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor,
                             experts: GroupedMLP, rows: Optional[tuple[int, bool]] = None) -> torch.Tensor:
        """Expert outputs for tokens ``x [T, h]``, weighted by ``probs`` and summed per token: ``[T, h]``.
        ``rows``: the routed row count (``permute``)."""
        permuted, permutation = permute(x, routing_map, rows)
        y = experts(permuted, permutation.tokens_per_expert)
        return unpermute(y, probs, permutation, x.shape[0])

# --------------------------------------------------------------------------------------------- the layer

class MoELayer(nn.Module):
    """Router + routed experts (+ shared experts): the MLP of an MoE transformer layer.

    ``forward(hidden_states [b, s, h]) -> [b, s, h]``. While training it accumulates, per layer, the
    load-balancing loss and z-loss (without their coefficients) and the tokens each expert received; see
    ``moe_layer_metrics``.
    """

    is_moe = True

    def __init__(self, config: TransformerArgs, layer_number: int) -> None:
        super().__init__()
        moe = config.moe
        self.layer_number = layer_number
        self.num_experts = moe.num_experts
        self.router = TopKRouter(config.hidden_size, moe, config.init_method_std, config.params_dtype,
                                 bias=bool(config.add_bias_linear))
        self.experts = GroupedMLP(config, moe)
        self.shared_experts = SharedExpertMLP(config, moe) if moe.shared_ffn_hidden_size else None
        self.fc1_latent_proj: Optional[nn.Linear] = None
        self.fc2_latent_proj: Optional[nn.Linear] = None
        if moe.latent_size:  # Megatron: init_method down, output_layer_init_method up
            std, bias, dtype = config.init_method_std, bool(config.add_bias_linear), config.params_dtype
            self.fc1_latent_proj = _linear(config.hidden_size, moe.latent_size, bias, std, dtype)
            self.fc2_latent_proj = _linear(moe.latent_size, config.hidden_size, bias,
                                           std / math.sqrt(2.0 * config.num_layers), dtype)
        self.token_dispatcher: Any = LocalTokenDispatcher()
        self.layer_recompute = moe.layer_recompute
        self.reset_metrics()

    def reset_metrics(self) -> None:
        """Zero the accumulated metrics (done after each logged iteration). The sums exist from the start, with
        fixed names, shapes and device, so a compiled layer finds the same structure on every step."""
        moe, device = self.router.moe, self.router.weight.device
        shapes: dict[str, tuple[int, ...]] = {"tokens_per_expert": (moe.num_experts,)}
        if moe.aux_loss_coeff > 0:
            shapes["load_balancing_loss"] = ()
        if moe.z_loss_coeff is not None:
            shapes["z_loss"] = ()
        self.metrics = {name: torch.zeros(shape, dtype=torch.float64, device=device) for name, shape in shapes.items()}
        self.metric_steps = torch.zeros((), dtype=torch.float64, device=device)

    def _apply(self, fn: Callable[..., Any], recurse: bool = True) -> "MoELayer":
        super()._apply(fn, recurse)
        device = self.router.weight.device
        if self.metric_steps.device != device:  # the sums follow the parameters (fresh after a meta build)
            if self.metric_steps.is_meta:
                self.reset_metrics()
            else:
                self.metrics = {name: value.to(device) for name, value in self.metrics.items()}
                self.metric_steps = self.metric_steps.to(device)
        return self

    def _track(self, tracked: dict[str, torch.Tensor], routing_map: torch.Tensor) -> None:
        tracked = dict(tracked)
        tracked["tokens_per_expert"] = routing_map.sum(dim=0)
        for name, value in tracked.items():
            self.metrics[name] = self.metrics[name] + value.detach().to(torch.float64)
        self.metric_steps = self.metric_steps + 1

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.layer_recompute and self.training and torch.is_grad_enabled():
            # The replay in backward runs while autograd does (in_backward_pass), so the router's token counts
            # and this layer's metrics are recorded by the first forward only.
            return checkpoint(self._forward, hidden_states, use_reentrant=False)
        return self._forward(hidden_states)

    def _forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        probs, routing_map = self.router(x)
        if self.training and torch.is_grad_enabled() and not in_backward_pass():
            self._track(self.router.last_tracked, routing_map)
        routed = x if self.fc1_latent_proj is None else self.fc1_latent_proj(x)
        out = self.token_dispatcher.dispatch_and_combine(routed, probs, routing_map, self.experts,
                                                         rows=self.router.routed_rows(x.shape[0]))
        if self.fc2_latent_proj is not None:
            out = self.fc2_latent_proj(out)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out.view(shape)


def moe_layers(model: nn.Module | list[nn.Module]) -> list[MoELayer]:
    """The MoE layers of a model (or of a list of model chunks), in module order."""
    chunks = model if isinstance(model, list) else [model]
    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, MoELayer)]


def moe_layer_metrics(model: nn.Module | list[nn.Module]) -> dict[int, dict[str, torch.Tensor]]:
    """Per MoE layer (keyed by global layer number): the metrics summed since the last reset (float64, CPU):
    ``load_balancing_loss`` / ``z_loss`` (sums over forward passes, without coefficients, when enabled),
    ``tokens_per_expert`` ([E] routed tokens after dropping) and ``steps`` (forward passes counted)."""
    out: dict[int, dict[str, torch.Tensor]] = {}
    for layer in moe_layers(model):
        values = dict(layer.metrics)
        values = {name: value.cpu() for name, value in values.items()}
        values["steps"] = layer.metric_steps.detach().cpu()
        out[layer.layer_number] = values
    return out


def reset_moe_metrics(model: nn.Module | list[nn.Module]) -> None:
    """Clear every MoE layer's accumulated metrics."""
    for layer in moe_layers(model):
        layer.reset_metrics()
