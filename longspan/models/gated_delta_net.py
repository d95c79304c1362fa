"""The gated DeltaNet mixer: the linear-attention layers of the Qwen3-Next / Qwen3.5 hybrids (Megatron's
``experimental_attention_variant='gated_delta_net'``, HF's ``Qwen3_5GatedDeltaNet``).

It sits in a ``TransformerLayer``'s ``self_attention`` slot (the layer's norms, MLP/MoE, recompute and pipeline
code stay the same), with the same call signature as ``SelfAttention``. Parameters (module names)::

    linear_q, linear_k          nn.Linear [key_heads · key_head_dim, hidden]
    linear_v, linear_z          nn.Linear [value_heads · value_head_dim, hidden]   (values, output gate)
    linear_b, linear_a          nn.Linear [value_heads, hidden]                    (write strength β, decay step)
    conv_q, conv_k, conv_v      depthwise causal nn.Conv1d, weight [channels, 1, conv_kernel], no bias
    dt_bias, A_log              [value_heads]
    norm                        gated RMSNorm over value_head_dim, weight [value_head_dim]
    linear_proj                 nn.Linear [hidden, value_heads · value_head_dim]

Hugging Face fuses q/k/v into ``in_proj_qkv`` and ``conv1d`` (channels ``[q | k | v]``); here each is its own
module so tensor parallel splits them by heads as plain column splits (the conversion tables fuse and split).

The forward, per token: project; ``silu(causal depthwise conv)`` over q, k and v; L2-normalise q and k;
``β = sigmoid(b)``; the log decay ``g = -exp(A_log) · softplus(a + dt_bias)``; the gated delta rule
(``longspan.models.gated_delta_rule``: chunked for a whole sequence, flash-linear-attention's kernel on CUDA
when installed; one step at a time when decoding); the
gated norm ``rmsnorm(o) · weight · silu(z)`` per value head; ``linear_proj``. The forward reads the parameters
this process holds (``local_parameters``) and the head counts from their shapes, so a tensor-parallel rank runs
its own heads (``longspan.parallel.gated_delta_net``). ``context_parallel``, when a plan sets it, exchanges the
projected sequence chunks for the whole sequence of a share of the heads before the conv and back before
``linear_proj``.

Packed sequences (``cu_seqlens``): the conv and the rule run on each document on its own, so no state crosses
a document boundary (``DocumentLayout``). Adapters (``longspan.peft``) on the projections run through
their layers' ``local_forward``, on the same local tensors. Generation (``kv_cache``): the layer's conv inputs' last
``conv_kernel - 1`` positions and its rule state are its cache (``KVCache.linear_states``).
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from longspan.models.args import TransformerArgs
from longspan.models.gated_delta_rule import DocumentLayout, chunked_gated_delta_rule, recurrent_gated_delta_rule
from longspan.models.local import local_linear, local_tensor

if TYPE_CHECKING:  # the decoder layers in longspan.models.transformer build this mixer
    from longspan.models.transformer import KVCache

#: the conv segments, in Hugging Face's fused channel order
CONV_SEGMENTS = ("q", "k", "v")
#: the input projections (Megatron fuses them into one ``in_proj``), in the order the forward reads them
IN_PROJECTIONS = ("linear_q", "linear_k", "linear_v", "linear_z", "linear_b", "linear_a")

# Megatron GatedDeltaNet's A_log initialization range (A = exp(A_log) drawn uniformly in it); dt_bias starts at 1.
_A_INIT_RANGE = (1.0, 16.0)
# The L2 norm's epsilon inside the square root (HF's and flash-linear-attention's l2norm)
_L2_EPS = 1e-6


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """``x / sqrt(sum(x²) + 1e-6)`` over the last dimension, in float32."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + _L2_EPS)


def _shared_local(weight: torch.Tensor) -> torch.Tensor:
    """The local tensor of a weight every head shares (the gated norm's): under tensor parallel a replicated
    DTensor, whose gradient here is the partial sum over this rank's heads, summed over the ranks on the way back."""
    to_local = getattr(weight, "to_local", None)
    if not callable(to_local):
        return weight
    from torch.distributed.tensor import Partial  # slow to import; already loaded wherever a DTensor exists

    return to_local(grad_placements=[Partial()] * len(weight.placements))


def _draw_A_log(shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
    return torch.empty(shape).uniform_(*_A_INIT_RANGE, generator=generator).log()


class GatedRMSNorm(nn.Module):
    """``weight · rmsnorm(x) · silu(gate)`` over the last dimension (one value head), normalised in float32, the
    weighted norm cast to ``x``'s dtype before the gate (HF's ``Qwen3_5RMSNormGated``, norm before gate). The
    weight is stored as is (not zero-centred)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.normalized_shape = (dim,)
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """``weight`` replaces ``self.weight`` (the local tensor of a parallel layout)."""
        weight = self.weight if weight is None else weight
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return ((weight * normed.to(x.dtype)) * F.silu(gate.float())).to(x.dtype)


def _linear(in_features: int, out_features: int, std: float, dtype: torch.dtype) -> nn.Linear:
    layer = nn.Linear(in_features, out_features, bias=False, dtype=dtype)
    layer.init_std = std  # read by init_weights
    return layer


def _depthwise_conv(channels: int, kernel: int, dtype: torch.dtype) -> nn.Conv1d:
    conv = nn.Conv1d(channels, channels, kernel, groups=channels, bias=False, dtype=dtype)
    # PyTorch's default conv init (kaiming_uniform(a=√5)) in bound form, as Megatron keeps it.
    conv.init_rule = ("uniform", 1.0 / math.sqrt(kernel))
    return conv


class GatedDeltaNet(nn.Module):
    """The gated DeltaNet mixer of one layer (see the module docstring). ``forward(hidden [b, s, hidden], rotary,
    attention_mask, *, kv_cache, cu_seqlens) -> [b, s, hidden]``; ``rotary`` and ``attention_mask`` are unused (the
    layer is causal by construction and position-free)."""

    def __init__(self, config: TransformerArgs, layer_number: int) -> None:
        super().__init__()
        m = config.gated_delta_net
        self.layer_number = layer_number
        self.key_head_dim, self.value_head_dim = m.key_head_dim, m.value_head_dim
        self.conv_kernel, self.chunk_size = m.conv_kernel, m.chunk_size
        key_dim, value_dim = m.num_key_heads * m.key_head_dim, m.num_value_heads * m.value_head_dim
        hidden, dtype, std = config.hidden_size, config.params_dtype, config.init_method_std
        self.linear_q = _linear(hidden, key_dim, std, dtype)
        self.linear_k = _linear(hidden, key_dim, std, dtype)
        self.linear_v = _linear(hidden, value_dim, std, dtype)
        self.linear_z = _linear(hidden, value_dim, std, dtype)
        self.linear_b = _linear(hidden, m.num_value_heads, std, dtype)
        self.linear_a = _linear(hidden, m.num_value_heads, std, dtype)
        self.conv_q = _depthwise_conv(key_dim, m.conv_kernel, dtype)
        self.conv_k = _depthwise_conv(key_dim, m.conv_kernel, dtype)
        self.conv_v = _depthwise_conv(value_dim, m.conv_kernel, dtype)
        self.dt_bias = nn.Parameter(torch.empty(m.num_value_heads, dtype=dtype))
        self.A_log = nn.Parameter(torch.empty(m.num_value_heads, dtype=dtype))
        self.init_rule = {"dt_bias": ("ones", 0.0), "A_log": ("draw", _draw_A_log)}
        self.norm = GatedRMSNorm(m.value_head_dim, config.layernorm_epsilon, dtype)
        out_std = std / math.sqrt(2.0 * config.num_layers)
        self.linear_proj = _linear(value_dim, hidden, out_std, dtype)
        self.context_parallel: Any = None

    def local_parameters(self) -> SimpleNamespace:
        """The parameters this process computes with (a DTensor's local shard: a tensor-parallel rank's heads)."""
        p = {name: local_tensor(getattr(self, name).weight) for name in (*IN_PROJECTIONS, "linear_proj")}
        p["conv"] = tuple(local_tensor(getattr(self, f"conv_{seg}").weight) for seg in CONV_SEGMENTS)
        p.update(dt_bias=local_tensor(self.dt_bias), A_log=local_tensor(self.A_log),
                 norm=_shared_local(self.norm.weight))
        return SimpleNamespace(**p)

    def forward(
        self,
        hidden_states: torch.Tensor,
        rotary: object = None,
        attention_mask: object = None,
        *,
        kv_cache: KVCache | None = None,
        cu_seqlens: torch.Tensor | DocumentLayout | None = None,
    ) -> torch.Tensor:
        """``cu_seqlens``: the packed documents' boundaries, or their ``DocumentLayout`` (the decoder builds it once
        for all its layers)."""
        p = self.local_parameters()
        segments = [self._project(name, hidden_states, p) for name in IN_PROJECTIONS]
        if self.context_parallel is not None:  # the whole sequence of this rank's share of the heads
            segments = self.context_parallel.to_heads(segments)
            p = self.context_parallel.heads_of(p)
        q, k, v, z, b_logits, a = segments
        b, s, _ = q.shape
        qkv = torch.cat([q, k, v], dim=-1)
        beta = torch.sigmoid(b_logits)
        g = -p.A_log.float().exp() * F.softplus(a.float() + p.dt_bias.float())
        cache = kv_cache.linear_states.get(self.layer_number) if kv_cache is not None else None
        if cache is not None:
            out = self._continue(qkv, g, beta, cache, p)
        elif cu_seqlens is not None:
            if kv_cache is not None:
                raise ValueError("a gated DeltaNet layer takes packed documents (cu_seqlens) or a cache, not both")
            layout = cu_seqlens if isinstance(cu_seqlens, DocumentLayout) else \
                DocumentLayout.from_cu_seqlens(cu_seqlens, b, s)
            out = layout.merge(self._sequence(*(layout.split(t) for t in (qkv, g, beta)), p)[0])
        else:
            out, state = self._sequence(qkv, g, beta, p, final_state=kv_cache is not None)
            if kv_cache is not None:
                kv_cache.linear_states[self.layer_number] = {"conv": self._conv_tail(qkv), "state": state}
        out = self.norm(out, z.view(b, s, -1, self.value_head_dim), p.norm).reshape(b, s, -1)
        if self.context_parallel is not None:
            out = self.context_parallel.to_sequence(out)
        return self._project("linear_proj", out, p)

    def _project(self, name: str, x: torch.Tensor, p: SimpleNamespace) -> torch.Tensor:
        """Projection ``name`` with this process's part of its weight; an adapted projection (``longspan.peft``
        wraps it) adds its adapter's output, computed on local tensors too."""
        return local_linear(getattr(self, name), x, getattr(p, name))

    def _conv(self, qkv: torch.Tensor, p: SimpleNamespace, tail: torch.Tensor | None = None) -> torch.Tensor:
        """``silu`` of the causal depthwise conv over ``qkv [b, s, channels]``; the window before the first token
        is ``tail [b, channels, conv_kernel - 1]`` (zeros when None)."""
        x = qkv.transpose(1, 2)
        x = F.pad(x, (self.conv_kernel - 1, 0)) if tail is None else torch.cat([tail.to(x.dtype), x], dim=-1)
        weight = torch.cat(p.conv)
        return F.silu(F.conv1d(x, weight, groups=weight.shape[0])).transpose(1, 2)

    def _conv_tail(self, qkv: torch.Tensor, tail: torch.Tensor | None = None) -> torch.Tensor:
        """The conv inputs the next token's window starts with: the last ``conv_kernel - 1`` positions."""
        x = qkv.transpose(1, 2)
        x = F.pad(x, (self.conv_kernel - 1, 0)) if tail is None else torch.cat([tail.to(x.dtype), x], dim=-1)
        return x[..., x.shape[-1] - (self.conv_kernel - 1):].clone()

    def _rule_inputs(self, mixed: torch.Tensor, p: SimpleNamespace) -> tuple[torch.Tensor, ...]:
        b, s, _ = mixed.shape
        key_dim = p.linear_q.shape[0]
        q, k, v = mixed.split([key_dim, key_dim, p.linear_v.shape[0]], dim=-1)
        q = l2_normalize(q.reshape(b, s, -1, self.key_head_dim))
        k = l2_normalize(k.reshape(b, s, -1, self.key_head_dim))
        return q, k, v.reshape(b, s, -1, self.value_head_dim)

    def _sequence(self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, p: SimpleNamespace,
                  final_state: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A whole sequence (each row from its start): conv, then the chunked rule from a zero state."""
        q, k, v = self._rule_inputs(self._conv(qkv, p), p)
        return chunked_gated_delta_rule(q, k, v, g, beta, chunk_size=self.chunk_size, output_final_state=final_state)

    def _continue(self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, cache: dict[str, torch.Tensor],
                  p: SimpleNamespace) -> torch.Tensor:
        """Tokens after cached ones: the conv window starts with the cached tail and the rule with the cached
        state (one step at a time for a single token, chunked for more); the cache is advanced."""
        q, k, v = self._rule_inputs(self._conv(qkv, p, cache["conv"]), p)
        if qkv.shape[1] == 1:
            out, state = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=cache["state"],
                                                    output_final_state=True)
        else:
            out, state = chunked_gated_delta_rule(q, k, v, g, beta, chunk_size=self.chunk_size,
                                                  initial_state=cache["state"], output_final_state=True)
        cache["conv"] = self._conv_tail(qkv, cache["conv"])
        cache["state"] = state
        return out
