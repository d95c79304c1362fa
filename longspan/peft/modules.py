"""Adapter modules: the low-rank path and the adapted linear layer.

An adapted layer stays an ``nn.Linear`` with the same ``weight``/``bias`` names (so base checkpoints load by
name and tensor-parallel plans still see a linear layer) and gains a child ``adapter``::

    decoder.layers.0.self_attention.linear_q.weight                  frozen base
    decoder.layers.0.self_attention.linear_q.adapter.linear_in.weight    A [dim, in]
    decoder.layers.0.self_attention.linear_q.adapter.linear_out.weight   B [out, dim]
    decoder.layers.0.self_attention.linear_q.adapter.weight_magnitude    m [out]       (DoRA)

Megatron's fused ``linear_qkv`` (and ``linear_fc1`` = gate + up) adapter is ONE ``A`` over the input and a ``B``
whose rows are split over q, k and v: here the A lives in the first member (``linear_q``, or ``linear_fc1``
for gate/up) and the other members read it from there (a plain reference, not a second registration), each
holding its own slice of B. The members of a group receive the same input in one forward, so the dropped-out
input and ``A x`` are computed once and shared, exactly as in the fused layer.

Under tensor parallel (``adapt_parallel_style``) the adapter is split the way its base layer is: a
column-parallel base keeps A replicated and splits B (and m) by output rows; a row-parallel base splits A by
input columns and keeps B (and m) replicated. The adapter then runs inside the base layer's DTensor region,
so its partial sums are reduced together with the base output. Under sequence parallel nothing changes for
the adapters: the plan all-gathers the attention/MLP inputs before the column-parallel layers (adapter
included), and a row-parallel layer's output, adapter part included, is reduce-scattered as one sum.

Adapter dropout (``FullMaskDropout``) draws the mask of the whole tensor, as one process draws it, and keeps
this rank's part, so tensor and sequence parallel runs drop the same elements as one process (and consume
the same random numbers). Under context or pipeline parallel the masks are drawn per rank.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from longspan.core.errors import NotSupportedError
from longspan.models.moe_dispatch import pad_rows, split_by_expert


def init_rule(method: str, fan_in: int, fan_out: int) -> tuple[str, float]:
    """The ``longspan.models.init`` rule of Megatron Bridge's adapter init methods for a ``[fan_out, fan_in]``
    weight: 'xavier' = xavier normal, 'kaiming' = kaiming uniform (a=sqrt(5)), 'normal' = N(0, 0.2), 'zero'."""
    if method == "xavier":
        return ("normal", math.sqrt(2.0 / (fan_in + fan_out)))
    if method == "kaiming":
        return ("uniform", 1.0 / math.sqrt(fan_in))
    if method == "normal":
        return ("normal", 0.2)
    if method == "zero":
        return ("zeros", 0.0)
    raise ValueError(f"unknown adapter init method {method!r}")


def _linear(in_features: int, out_features: int, rule: tuple[str, float], dtype: Optional[torch.dtype],
            device: Any) -> nn.Linear:
    layer = nn.Linear(in_features, out_features, bias=False, dtype=dtype, device=device)
    layer.init_rule = rule  # read by longspan.models.init.init_weights
    return layer


def _local_storage_key(t: torch.Tensor) -> tuple:
    local = getattr(t, "_local_tensor", t)  # a DTensor's local shard
    # Inference-mode tensors (generation) have no version counter; they cannot be modified in place either.
    version = None if local.is_inference() else local._version
    return (local.data_ptr(), tuple(local.shape), tuple(local.stride()), version)


class FullMaskDropout(nn.Dropout):
    """Dropout that is the same under every tensor-parallel split of its input.

    The mask is drawn for the full (global) shape exactly as ``F.dropout`` on the whole tensor draws it, then
    applied to this rank's part: a DTensor input (replicated, split, or a row-parallel layer's partial sums,
    for which dropping is linear) is multiplied by the replicated mask, which DTensor slices locally. A plain
    tensor takes the same path (``x * dropout(ones)``, which is what ``F.dropout`` computes on CPU).
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        local = getattr(x, "_local_tensor", x)
        mask = F.dropout(torch.ones(x.shape, dtype=x.dtype, device=local.device), self.p, True)
        mesh = getattr(x, "device_mesh", None)
        if mesh is not None:
            mask = DTensor.from_local(mask, mesh, [Replicate()] * mesh.ndim, run_check=False)
        return x * mask


class LoRAAdapter(nn.Module):
    """``scale · linear_out(linear_in(dropout(x)))`` ('pre' dropout) or ``scale · dropout(linear_out(linear_in(x)))``
    ('post'). A group member without its own ``linear_in`` uses the group owner's (see the module docstring).

    ``weight_magnitude`` (DoRA) is the per-output-row magnitude; its initial value is set from the base weight
    once the base is loaded (``init_magnitude``).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        dim: int,
        scale: float,
        dropout: float,
        dropout_position: str,
        a_init: str,
        b_init: str,
        dtype: Optional[torch.dtype],
        device: Any,
        owner: Optional["LoRAAdapter"] = None,
        group_size: int = 1,
        dora: bool = False,
    ) -> None:
        super().__init__()
        self.dim = dim
        self.scale = scale
        self.dropout_position = dropout_position
        self.dropout = FullMaskDropout(dropout) if dropout > 0 else None
        if owner is None:
            self.linear_in: Optional[nn.Linear] = _linear(in_features, dim, init_rule(a_init, in_features, dim), dtype,
                                                          device)
        else:
            self.linear_in = None
        # The owner of the shared A (self when it has its own); a plain attribute, never a registered child.
        object.__setattr__(self, "_owner", owner if owner is not None else self)
        self.group_size = group_size
        self.linear_out = _linear(dim, out_features, init_rule(b_init, dim, out_features), dtype, device)
        if dora:
            self.weight_magnitude: Optional[nn.Parameter] = nn.Parameter(
                torch.empty(out_features, dtype=dtype, device=device)
            )
            self.init_rule = ("ones", 0.0)  # placeholder until init_magnitude: the base's row norms
        else:
            self.weight_magnitude = None
        self._cache: Optional[tuple] = None
        self._cache_uses = 0

    @property
    def owner(self) -> "LoRAAdapter":
        return self._owner

    @property
    def shared_in(self) -> nn.Linear:
        """The A of this adapter (its own or its group owner's)."""
        return self._owner.linear_in

    def low_rank(self, x: torch.Tensor, local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(the adapter's input after 'pre' dropout, ``A`` applied to it); computed once per forward for a
        group whose members share A (the owner caches the result for the other members). ``local``: ``x`` and
        the result are this process's local tensors (``local_output``)."""
        owner = self._owner
        if owner.group_size > 1 and owner._cache is not None and owner._cache[0] == _local_storage_key(x):
            result = owner._cache[2]
            owner._cache_uses += 1
            if owner._cache_uses >= owner.group_size:  # every member has read it: let it go
                owner._cache = None
            return result
        if local:
            a = owner.linear_in.weight
            dx = self._local_dropout(x, a) if self.dropout is not None and self.dropout_position == "pre" else x
            result = (dx, F.linear(dx, local_factor(a)))
        else:
            dx = self.dropout(x) if self.dropout is not None and self.dropout_position == "pre" else x
            result = (dx, owner.linear_in(dx))
        if owner.group_size > 1:
            owner._cache = (_local_storage_key(x), x, result)
            owner._cache_uses = 1
        return result

    def lora_output(self, h: torch.Tensor, local: bool = False) -> torch.Tensor:
        """``scale · B h`` with 'post' dropout (``local``: on local tensors, see ``local_output``)."""
        out = F.linear(h, local_factor(self.linear_out.weight)) if local else self.linear_out(h)
        if self.dropout is not None and self.dropout_position == "post":
            out = self.dropout(out)
        return out * self.scale

    def delta_weight(self) -> torch.Tensor:
        """``scale · B A`` (``[out, in]``), the update LoRA adds to the base weight."""
        return (self.linear_out.weight @ self.shared_in.weight) * self.scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lora_output(self.low_rank(x)[1])

    def local_output(self, x: torch.Tensor) -> torch.Tensor:
        """The adapter's output computed on local tensors, for a mixer that computes with its parameters' local
        shards (the gated DeltaNet's projections, ``longspan.parallel.gated_delta_net``): ``x`` is this process's
        input (a column-split layer's whole input, a row-split layer's slice of it) and the result its part of
        the output (a row-split layer's partial sum, reduced with the base's). A replicated factor's gradient
        here is this rank's partial sum, summed over the ranks on the way back."""
        return self.lora_output(self.low_rank(x, local=True)[1], local=True)

    def _local_dropout(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """'pre' dropout of a local input: a row-split layer's slice of the input is dropped with the mask of
        the whole input, as one process draws it (``FullMaskDropout``), and this rank's part of it kept."""
        mesh = getattr(a, "device_mesh", None)
        if mesh is None or not isinstance(a.placements[-1], Shard):
            return self.dropout(x)
        whole = DTensor.from_local(x, mesh, [Replicate()] * (mesh.ndim - 1) + [Shard(x.dim() - 1)], run_check=False)
        return self.dropout(whole).to_local()


def local_factor(weight: torch.Tensor) -> torch.Tensor:
    """The local tensor of an adapter factor (``LoRAAdapter.local_output``): a DTensor's shard, a replicated
    one's whole tensor whose gradient is summed over the ranks (``Partial``), a plain tensor as it is."""
    if not isinstance(weight, DTensor):
        return weight
    if all(isinstance(p, Replicate) for p in weight.placements):
        return weight.to_local(grad_placements=[Partial()] * len(weight.placements))
    return weight.to_local()


class LoRALinear(nn.Linear):
    """A base ``nn.Linear`` (same parameters, same names) plus a LoRA ``adapter``: ``W x + b + s·B A x``."""

    def __init__(self, base: nn.Linear, adapter: LoRAAdapter) -> None:
        nn.Module.__init__(self)
        self.in_features = base.in_features
        self.out_features = base.out_features
        self.weight = base.weight
        self.bias = base.bias
        for attr in ("init_std", "init_rule"):
            if hasattr(base, attr):
                setattr(self, attr, getattr(base, attr))
        self.adapter = adapter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + self.adapter(x)

    def local_forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The layer on local tensors: ``weight`` is this process's part of the base weight (see
        ``LoRAAdapter.local_output``); no bias (the mixers that call it have none)."""
        return F.linear(x, weight) + self.adapter.local_output(x)

    def merged_weight(self) -> torch.Tensor:
        """The base weight with the adapter folded in (``W + s·B A``)."""
        return self.weight + self.adapter.delta_weight().to(self.weight.dtype)

    # ---- tensor parallel ------------------------------------------------------------------------------
    def adapt_parallel_style(self, style: Any) -> Any:
        """``style`` (ColwiseParallel / RowwiseParallel for the base layer) made to place the adapter too."""
        if isinstance(style, ColwiseParallel):
            kind = "column"
        elif isinstance(style, RowwiseParallel):
            kind = "row"
        else:
            raise NotSupportedError(
                f"adapters on a layer planned with {type(style).__name__} are not supported under tensor parallel"
            )
        src = getattr(style, "src_data_rank", 0)

        def partition(name: str, module: nn.Module, mesh: Any) -> None:
            if name:  # the adapter's sub-modules: placed together with the root below
                return
            place_adapted_linear(module, mesh, kind, src)

        # The style's own partition function shards every parameter it finds recursively (the adapter's too);
        # this one places base and adapter parameters each the right way. The input/output handling is kept.
        style._partition_linear_fn = partition
        return style


class DoRALinear(LoRALinear):
    """DoRA: ``m ⊙ (W + s·B A) x / ||W + s·B A||_row + b`` with the norm detached (peft's formula):
    ``W x + b + (m/n - 1) ⊙ W dropout(x) + (m/n) ⊙ s·B A dropout(x)``."""

    def weight_norm(self) -> torch.Tensor:
        """Row norms of ``W + s·B A`` (over the input dimension), without gradient."""
        with torch.no_grad():
            full = self.weight + self.adapter.delta_weight().to(self.weight.dtype)
            return full.pow(2).sum(dim=1).sqrt()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = F.linear(x, self.weight, self.bias)
        dx, h = self.adapter.low_rank(x)
        scale = (self.adapter.weight_magnitude / self.weight_norm()).view(1, -1)
        if self.adapter.dropout is None or not self.adapter.dropout.training:
            base_no_bias = base if self.bias is None else base - self.bias
        else:  # dropout is on: the magnitude term sees the dropped-out input, as in peft
            base_no_bias = F.linear(dx, self.weight)
        return base + (scale - 1) * base_no_bias + scale * self.adapter.lora_output(h)

    def local_forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``forward`` on local tensors (``LoRALinear.local_forward``): the row norms are those of the whole
        weight (a row-split layer's are reduced over the ranks by DTensor), this rank's rows of them used."""
        base = F.linear(x, weight)
        dx, h = self.adapter.low_rank(x, local=True)
        norm = self.weight_norm()
        norm = norm.to_local() if isinstance(norm, DTensor) else norm
        scale = (local_factor(self.adapter.weight_magnitude) / norm).view(1, -1)
        dropped = self.adapter.dropout is not None and self.adapter.dropout.training
        base_no_bias = F.linear(dx, weight) if dropped else base
        return base + (scale - 1) * base_no_bias + scale * self.adapter.lora_output(h, local=True)

    def merged_weight(self) -> torch.Tensor:
        norm = self.weight_norm()
        full = self.weight + self.adapter.delta_weight().to(self.weight.dtype)
        return full * (self.adapter.weight_magnitude / norm).view(-1, 1)

    @torch.no_grad()
    def init_magnitude(self) -> None:
        """Set the magnitude to the row norms of the current ``W + s·B A`` (the base's own norms when B is 0),
        so the adapted layer starts equal to the base."""
        norm = self.weight_norm()
        magnitude = self.adapter.weight_magnitude
        local = getattr(magnitude, "_local_tensor", None)
        if local is not None:
            local.copy_(norm.redistribute(magnitude.device_mesh, magnitude.placements).to_local())
        else:
            magnitude.copy_(norm)


def place_adapted_linear(module: LoRALinear, mesh: Any, kind: str, src_data_rank: Any = 0) -> None:
    """Turn an adapted linear's parameters into DTensors on the 1-D ``mesh``: the base as ColwiseParallel /
    RowwiseParallel would, the adapter so that its maths matches the base split (module docstring)."""
    def place(owner: nn.Module, name: str, placement: Any) -> None:
        param = getattr(owner, name)
        if param is None:
            return
        owner.register_parameter(name, nn.Parameter(
            distribute_tensor(param, mesh, [placement], src_data_rank=src_data_rank),
            requires_grad=param.requires_grad,
        ))

    adapter = module.adapter
    if kind == "column":
        place(module, "weight", Shard(0))
        place(module, "bias", Shard(0))
        if adapter.linear_in is not None:
            place(adapter.linear_in, "weight", Replicate())
        place(adapter.linear_out, "weight", Shard(0))
        place(adapter, "weight_magnitude", Shard(0))
    else:
        place(module, "weight", Shard(1))
        place(module, "bias", Replicate())
        if adapter.linear_in is not None:
            place(adapter.linear_in, "weight", Shard(1))
        place(adapter.linear_out, "weight", Replicate())
        place(adapter, "weight_magnitude", Replicate())


# ----------------------------------------------------------------------------------------- MoE experts


class _GroupedWeight(nn.Module):
    """One ``weight [num_experts, out, in]`` (an adapter factor per expert), drawn by ``init_rule``."""

    def __init__(self, num_experts: int, in_features: int, out_features: int, rule: tuple[str, float],
                 dtype: Optional[torch.dtype], device: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features, dtype=dtype, device=device))
        self.init_rule = rule


class GroupedLoRAAdapter(nn.Module):
    """LoRA for the routed experts (``GroupedLinear [E, out, in]``): per expert ``A_e [dim, in]`` and
    ``B_e [out, dim]`` stored as 3-D ``linear_in.weight [E, dim, in]`` / ``linear_out.weight [E, out, dim]``.
    For Megatron's fused ``linear_fc1`` the gate reads the up projection's A (one A per expert)."""

    def __init__(self, num_experts: int, in_features: int, out_features: int, *, dim: int, scale: float,
                 dropout: float, dropout_position: str, a_init: str, b_init: str, dtype: Optional[torch.dtype],
                 device: Any, owner: Optional["GroupedLoRAAdapter"] = None) -> None:
        super().__init__()
        self.scale = scale
        self.dropout_position = dropout_position
        self.dropout = nn.Dropout(dropout) if dropout > 0 else None
        self.linear_in = None if owner is not None else _GroupedWeight(
            num_experts, in_features, dim, init_rule(a_init, in_features, dim), dtype, device)
        object.__setattr__(self, "_owner", owner if owner is not None else self)
        self.linear_out = _GroupedWeight(num_experts, dim, out_features, init_rule(b_init, dim, out_features), dtype,
                                         device)
        self._cache: Optional[tuple] = None

    @property
    def shared_in(self) -> _GroupedWeight:
        return self._owner.linear_in

    def expert_weights(self, weight_fn: Any) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """The per-expert ``(A_j, B_j)`` slices, unbound once per forward: indexing ``[j]`` per expert would make
        each expert's backward write a zero tensor of all experts' size (quadratic in the experts)."""
        return weight_fn(self.shared_in.weight).unbind(0), weight_fn(self.linear_out.weight).unbind(0)

    def expert_output(self, rows: torch.Tensor, j: int, weights: tuple[tuple[torch.Tensor, ...], ...]) -> torch.Tensor:
        """``scale · B_j A_j dropout(rows)`` for the rows routed to local expert ``j``; ``weights`` from
        :meth:`expert_weights`."""
        a, b = weights
        owner = self._owner
        key = (_local_storage_key(rows), j)
        if owner is not self and owner._cache is not None and owner._cache[0] == key:
            h = owner._cache[2]
            owner._cache = None
        else:
            dx = self.dropout(rows) if self.dropout is not None and self.dropout_position == "pre" else rows
            h = F.linear(dx, a[j])
            if owner is self and getattr(self, "has_members", False):  # the gate reads it next
                self._cache = (key, rows, h)
        out = F.linear(h, b[j])
        if self.dropout is not None and self.dropout_position == "post":
            out = self.dropout(out)
        return out * self.scale

    def delta_weight(self) -> torch.Tensor:
        """``scale · B_e A_e`` for every expert: ``[E, out, in]``."""
        return torch.bmm(self.linear_out.weight, self.shared_in.weight) * self.scale


def adapted_grouped_mlp_forward(self: Any, x: torch.Tensor, tokens_per_expert: torch.Tensor,
                                add_output_bias: bool = True) -> torch.Tensor:
    """``GroupedMLP.forward`` with the experts' adapters added to each projection (installed by
    ``longspan.peft.adapters`` on the experts it adapts)."""
    fn = self.weight_fn
    w1, w2 = fn(self.linear_fc1.weight), fn(self.linear_fc2.weight)
    gate = self.linear_fc1_gate
    wg = fn(gate.weight) if gate is not None else None
    b1 = fn(self.linear_fc1.bias) if self.linear_fc1.bias is not None else None
    bg = fn(gate.bias) if wg is not None and gate.bias is not None else None
    b2 = fn(self.linear_fc2.bias) if self.linear_fc2.bias is not None and add_output_bias else None

    out_width = w2.shape[1]
    # unbound once, not indexed per expert (see GroupedLoRAAdapter.expert_weights)
    w1, wg, w2, b1, bg, b2 = (None if t is None else t.unbind(0) for t in (w1, wg, w2, b1, bg, b2))
    adapter_weights = {id(layer): layer.adapter.expert_weights(fn)
                       for layer in (self.linear_fc1, gate, self.linear_fc2)
                       if layer is not None and getattr(layer, "adapter", None) is not None}

    def project(layer: nn.Module, rows: torch.Tensor, j: int, w: Sequence[torch.Tensor],
                b: Optional[Sequence[torch.Tensor]]) -> torch.Tensor:
        out = F.linear(rows, w[j], None if b is None else b[j])
        adapter = getattr(layer, "adapter", None)
        return out if adapter is None else out + adapter.expert_output(rows, j, adapter_weights[id(layer)])

    outputs = []
    for j, rows in enumerate(split_by_expert(x, tokens_per_expert)):
        up = project(self.linear_fc1, rows, j, w1, b1)
        h = self.activation_func(project(gate, rows, j, wg, bg)) * up if wg is not None else self.activation_func(up)
        outputs.append(project(self.linear_fc2, h, j, w2, b2))
    return pad_rows(torch.cat(outputs, dim=0) if outputs else x.new_zeros(0, out_width), x.shape[0])
