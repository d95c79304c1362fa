"""Mamba-2 and hybrid Mamba / attention models, built from a ``MambaProvider``.

Plain PyTorch with Megatron Core's module names (``megatron/core/ssm``), so checkpoints and parallel plans
address the same parameters::

    embedding.word_embeddings                          nn.Embedding [padded_vocab, hidden]
    decoder.layers.{i}.norm                            RMSNorm / LayerNorm          (Mamba layers 'M')
    decoder.layers.{i}.mixer.in_proj.{z,x,B,C,dt}      nn.Linear [d_inner | d_inner | groups·state (B, C) | heads, hidden]
    decoder.layers.{i}.mixer.conv1d.{x,B,C}            depthwise nn.Conv1d over d_inner | groups·state (B, C)
    decoder.layers.{i}.mixer.A_log / D / dt_bias       [heads] each
    decoder.layers.{i}.mixer.norm                      gated RMSNorm over d_inner (per group)
    decoder.layers.{i}.mixer.out_proj                  nn.Linear [hidden, d_inner]
    decoder.layers.{i}.input_layernorm, .self_attention.linear_q/k/v/proj    (attention layers '*')
    decoder.layers.{i}.pre_mlp_layernorm, .mlp.linear_fc1(_gate)/fc2         (MLP '-' and MoE 'E' layers)
    decoder.final_norm                                 (post_process only)
    output_layer                                       nn.Linear (absent when tied)

Megatron and Hugging Face fuse ``in_proj`` (rows ``[z | x | B | C | dt]``) and ``conv1d`` (``[x | B | C]``);
here each segment is its own parameter, so tensor parallel shards them by heads (the conversion tables fuse
and split them). The forward
contract is ``GPTModel``'s (``longspan.models.gpt``): per-token loss with labels, logits without, hidden states
on a non-last pipeline stage; ``attention_mask`` / ``position_ids`` reach only the attention layers (Mamba
layers are causal by construction). ``kv_cache`` (a ``KVCache``) also carries each Mamba layer's conv and SSM
state, so generation runs the recurrent form one token at a time.

Sliding windows (``window_size`` / ``window_attn_skip_freq``) reach the attention layers ('*') only, each counted
by its index in the whole stack, Mamba and MLP layers included: Megatron's MambaStack numbers every layer 1 ..
num_layers and ``is_layer_window_attention`` reads that number. So with ``window_attn_skip_freq=N`` the
attention layer at index i attends fully when ``(i + 1) % N == 0``, and a list holds one 0/1 entry per layer of
the stack (the entries of Mamba and MLP layers are read by no layer).
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from longspan.config.rules.model import check_mamba_model, mamba_inner_size
from longspan.core.errors import ConfigError
from longspan.models.args import MambaArgs, TransformerArgs
from longspan.models.gpt import DecoderLanguageModel
from longspan.models.gpt_provider import GPTModelProvider
from longspan.models.init import materialize_model
from longspan.models.local import local_linear, local_tensor
from longspan.models.moe import MoELayer
from longspan.models.ssd import ssd_chunked_scan, ssd_step
from longspan.models.transformer import (
    MLP,
    KVCache,
    SelfAttention,
    _linear,
    build_norm,
    layer_masks,
    norm_residual,
    sublayer_residual,
)

if TYPE_CHECKING:  # the provider imports this module to build its model
    from longspan.models.mamba_provider import MambaProvider

MAMBA, ATTENTION, MLP_LAYER, MOE = "M", "*", "-", "E"
LAYER_SYMBOLS = (MAMBA, ATTENTION, MLP_LAYER, MOE)

# Megatron MambaMixer's fixed initialization constants.
_A_INIT_RANGE = (1.0, 16.0)
_DT_MIN, _DT_MAX, _DT_INIT_FLOOR = 0.001, 0.1, 1e-4


def allocate_layers(num_layers: int, attention_ratio: float, mlp_ratio: float, pattern: str | None) -> list[str]:
    """The layer types (``M``, ``*``, ``-``, ``E``) of a hybrid stack: ``pattern`` when given, else Megatron's
    even spread of ``round(num_layers · ratio)`` attention layers (then MLP layers) among Mamba layers."""
    if pattern is not None:
        if len(pattern) != num_layers:
            raise ConfigError(
                f"model.hybrid_override_pattern={pattern!r} has {len(pattern)} layers but model.num_layers={num_layers}"
            )
        bad = sorted(set(pattern) - set(LAYER_SYMBOLS))
        if bad:
            raise ConfigError(
                f"model.hybrid_override_pattern={pattern!r} has {bad}: use M (Mamba), * (attention), - (MLP), E (MoE)"
            )
        return list(pattern)
    if not (0.0 <= attention_ratio <= 1.0 and 0.0 <= mlp_ratio <= 1.0 and attention_ratio + mlp_ratio <= 1.0):
        raise ConfigError(
            f"model.hybrid_attention_ratio={attention_ratio} and model.hybrid_mlp_ratio={mlp_ratio} must be in "
            "[0, 1] and sum to at most 1"
        )
    types = [MAMBA] * num_layers
    n_attention = round(num_layers * attention_ratio)
    n_mamba = num_layers - n_attention
    # Attention layers evenly spaced, the stack starting and ending with Mamba sections.
    section = n_mamba / (n_attention + 1)
    budget = section
    for i in range(num_layers):
        if budget < 0.5:
            types[i] = ATTENTION
            budget += section
        else:
            budget -= 1
    n_mlp = round(num_layers * mlp_ratio)
    if n_mlp > 0:
        # MLP layers replace Mamba layers, evenly spread (right-justified).
        ratio = (n_mamba - n_mlp) / n_mlp
        budget = ratio
        for i in range(num_layers):
            if types[i] == MAMBA:
                if budget < 0.5:
                    types[i] = MLP_LAYER
                    budget += ratio
                else:
                    budget -= 1
    return types


def resolve_mamba_args(config: MambaProvider) -> TransformerArgs:
    """Check ``config`` (a ``MambaProvider``: the model rules of ``longspan.config.rules.model``) and return the
    typed arguments: the attention / MLP layers' as GPT derives them, the layer pattern, and the mixer's sizes
    (Megatron's derivation of d_inner and heads)."""
    check_mamba_model(config)
    # the attention / MLP layers take GPTModelProvider's defaults for the GPT-only fields a MambaProvider lacks
    args = TransformerArgs.from_config(config, gpt=GPTModelProvider())
    args.layer_types = allocate_layers(
        config.num_layers, config.hybrid_attention_ratio, config.hybrid_mlp_ratio, config.hybrid_override_pattern
    )
    if MOE in args.layer_types and args.moe is None:
        raise ConfigError("model.hybrid_override_pattern has MoE layers ('E'): set model.num_moe_experts")
    if args.moe is not None:  # the pattern, not moe_layer_freq, says which layers are MoE
        args.moe.layer_flags = [t == MOE for t in args.layer_types]
    d_inner, heads = mamba_inner_size(config)
    args.mamba = MambaArgs(
        d_inner=d_inner,
        heads=heads,
        head_dim=config.mamba_head_dim,
        state_dim=config.mamba_state_dim,
        groups=config.mamba_num_groups,
        conv_kernel=config.mamba_conv_kernel,
        chunk_size=config.mamba_chunk_size,
        dt_limit_min=float(config.mamba_dt_limit_min),
    )
    return args


class GatedRMSNorm(nn.Module):
    """``rmsnorm(y · silu(z)) · weight`` with the mean square taken per group of ``group_size`` channels
    (Megatron's ``norm_before_gate=False`` with ``group_size = d_inner / groups``), in float32."""

    def __init__(self, dim: int, group_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.normalized_shape = (dim,)
        self.group_size = group_size
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """``weight`` replaces ``self.weight`` (a tensor-parallel rank passes its channels' slice)."""
        gated = y.float() * F.silu(z.float())
        grouped = gated.unflatten(-1, (-1, self.group_size))
        normed = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight if weight is None else weight) * normed.flatten(-2).to(y.dtype)


def _draw_A_log(shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
    return torch.empty(shape).uniform_(*_A_INIT_RANGE, generator=generator).log()


def _draw_dt_bias(shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
    """softplus(dt_bias) spread log-uniformly over [dt_min, dt_max] (Megatron's and the Mamba paper's init)."""
    u = torch.rand(shape, generator=generator)
    dt = torch.exp(u * (math.log(_DT_MAX) - math.log(_DT_MIN)) + math.log(_DT_MIN)).clamp(min=_DT_INIT_FLOOR)
    return dt + torch.log(-torch.expm1(-dt))  # the inverse of softplus


#: ``in_proj``'s row segments, in Megatron's and Hugging Face's fused order, and the conv's channel segments
IN_PROJ_SEGMENTS = ("z", "x", "B", "C", "dt")
CONV_SEGMENTS = ("x", "B", "C")


def _depthwise_conv(channels: int, kernel: int, dtype: torch.dtype) -> nn.Conv1d:
    conv = nn.Conv1d(channels, channels, kernel, groups=channels, padding=kernel - 1, bias=True, dtype=dtype)
    # PyTorch's default conv init (kaiming_uniform(a=√5)) in bound form, as Megatron keeps it.
    conv.init_rule = ("uniform", 1.0 / math.sqrt(kernel))
    return conv


class MambaMixer(nn.Module):
    """The Mamba-2 mixer: ``in_proj`` -> causal depthwise conv over (x, B, C) -> SSD scan -> gated norm ->
    ``out_proj``. ``forward(hidden [b, s, hidden]) -> [b, s, hidden]``.

    ``in_proj`` is one linear map per segment (``in_proj.z / .x / .B / .C / .dt``) and ``conv1d`` one depthwise
    conv per segment (``conv1d.x / .B / .C``), so a tensor-parallel plan can shard each by heads as a plain
    row split (checkpoint conversion fuses them into Megatron's / HF's ``in_proj`` and ``conv1d``). The
    forward reads the parameters this process holds (``local_parameters``) and derives the head counts from
    their shapes. ``context_parallel``, when a plan sets it (``longspan.parallel.mamba_context_parallel``),
    exchanges the projected sequence shard for the whole sequence of a share of the heads before the conv and
    back after the norm.
    """

    def __init__(self, args: TransformerArgs, layer_number: int) -> None:
        super().__init__()
        m = args.mamba
        self.layer_number = layer_number
        self.d_inner, self.heads, self.head_dim = m.d_inner, m.heads, m.head_dim
        self.groups, self.state_dim, self.chunk_size = m.groups, m.state_dim, m.chunk_size
        self.dt_limit_min = m.dt_limit_min
        self.conv_dim = m.d_inner + 2 * m.groups * m.state_dim
        dtype = args.params_dtype
        std = args.init_method_std
        rows = {"z": m.d_inner, "x": m.d_inner, "B": m.groups * m.state_dim, "C": m.groups * m.state_dim,
                "dt": m.heads}
        self.in_proj = nn.ModuleDict({k: _linear(args.hidden_size, rows[k], False, std, dtype)
                                      for k in IN_PROJ_SEGMENTS})
        self.conv1d = nn.ModuleDict({k: _depthwise_conv(rows[k], m.conv_kernel, dtype) for k in CONV_SEGMENTS})
        # Megatron keeps A_log, D and dt_bias in float32 whatever params_dtype is.
        self.A_log = nn.Parameter(torch.empty(m.heads))
        self.D = nn.Parameter(torch.empty(m.heads))
        self.dt_bias = nn.Parameter(torch.empty(m.heads))
        self.init_rule = {"A_log": ("draw", _draw_A_log), "D": ("ones", 0.0), "dt_bias": ("draw", _draw_dt_bias)}
        self.norm = GatedRMSNorm(m.d_inner, m.d_inner // m.groups, args.layernorm_epsilon, dtype)
        self.out_proj = _linear(m.d_inner, args.hidden_size, False, std / math.sqrt(2.0 * args.num_layers), dtype)
        self.context_parallel: Any = None

    def local_parameters(self) -> SimpleNamespace:
        """The parameters this process computes with (a DTensor's local shard: a tensor-parallel rank's heads)
        and the sizes they imply. ``in_proj`` / ``conv_weight`` / ``conv_bias`` are tuples in segment order."""
        in_proj = tuple(local_tensor(self.in_proj[k].weight) for k in IN_PROJ_SEGMENTS)
        A_log = local_tensor(self.A_log)
        return SimpleNamespace(
            in_proj=in_proj,
            conv_weight=tuple(local_tensor(self.conv1d[k].weight) for k in CONV_SEGMENTS),
            conv_bias=tuple(local_tensor(self.conv1d[k].bias) for k in CONV_SEGMENTS),
            A_log=A_log, D=local_tensor(self.D), dt_bias=local_tensor(self.dt_bias),
            norm=local_tensor(self.norm.weight), out_proj=local_tensor(self.out_proj.weight),
            d_inner=in_proj[1].shape[0], heads=A_log.shape[0], groups=in_proj[2].shape[0] // self.state_dim,
        )

    def _project(self, hidden_states: torch.Tensor, p: SimpleNamespace) -> tuple[torch.Tensor, ...]:
        """in_proj: the five segments ``z, x, B, C, dt`` (an adapted segment adds its adapter's output)."""
        return tuple(local_linear(self.in_proj[k], hidden_states, w) for k, w in zip(IN_PROJ_SEGMENTS, p.in_proj))

    def _ssm_inputs(self, xbc: torch.Tensor, dt: torch.Tensor, p: SimpleNamespace) -> tuple[torch.Tensor, ...]:
        b, s, _ = xbc.shape
        x, B, C = xbc.split([p.d_inner, p.groups * self.state_dim, p.groups * self.state_dim], dim=-1)
        x = x.view(b, s, p.heads, self.head_dim)
        B = B.view(b, s, p.groups, self.state_dim)
        C = C.view(b, s, p.groups, self.state_dim)
        dt = F.softplus(dt.float() + p.dt_bias.float())
        if self.dt_limit_min > 0:
            dt = dt.clamp(min=self.dt_limit_min)
        return x, B, C, dt

    def forward(self, hidden_states: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        p = self.local_parameters()
        states = _mamba_states(cache)
        if states is not None and self.layer_number in states:
            return self._step_tokens(hidden_states, states[self.layer_number], p)
        segments = self._project(hidden_states, p)
        if self.context_parallel is not None:  # the whole sequence of this rank's share of the heads
            segments = self.context_parallel.to_heads(segments)
            p = self.context_parallel.heads_of(p)
        z, x, B, C, dt = segments
        xbc_in = torch.cat([x, B, C], dim=-1)
        b, s, _ = xbc_in.shape
        k = p.conv_weight[0].shape[-1]
        conv = F.conv1d(xbc_in.transpose(1, 2), torch.cat(p.conv_weight), torch.cat(p.conv_bias), padding=k - 1,
                        groups=xbc_in.shape[-1])
        xbc = F.silu(conv[..., :s].transpose(1, 2))
        x, B, C, dt = self._ssm_inputs(xbc, dt, p)
        A = -torch.exp(p.A_log.float())
        y, final_state = ssd_chunked_scan(x, dt, A, B, C, self.chunk_size)
        y = y + x.float() * p.D.float()[:, None]
        if states is not None:  # prefill: keep the conv inputs' tail and the SSM state for the next tokens
            tail = F.pad(xbc_in.transpose(1, 2), (max(0, k - 1 - s), 0))[..., -(k - 1):] if k > 1 else None
            states[self.layer_number] = {"conv": tail, "ssm": final_state}
        y = self.norm(y.reshape(b, s, p.d_inner).to(hidden_states.dtype), z, p.norm)
        if self.context_parallel is not None:
            y = self.context_parallel.to_sequence(y)
        return local_linear(self.out_proj, y, p.out_proj)

    def _step_tokens(self, hidden_states: torch.Tensor, state: dict[str, torch.Tensor],
                     p: SimpleNamespace) -> torch.Tensor:
        """The recurrent form: one token at a time from the cached conv inputs and SSM state."""
        outputs = []
        weight = torch.cat(p.conv_weight)[:, 0]  # [conv_dim, k]
        bias = torch.cat(p.conv_bias)
        A = -torch.exp(p.A_log.float())
        heads_per_group = p.heads // p.groups
        for t in range(hidden_states.shape[1]):
            z, x, B, C, dt = self._project(hidden_states[:, t : t + 1], p)
            window = torch.cat([x, B, C], dim=-1).transpose(1, 2)
            if state["conv"] is not None:
                window = torch.cat([state["conv"], window], dim=-1)  # [b, conv_dim, k]
                state["conv"] = window[..., 1:]
            xbc = F.silu((window * weight).sum(-1) + bias)[:, None]
            x, B, C, dt = self._ssm_inputs(xbc, dt, p)
            Bh = B[:, 0].float().repeat_interleave(heads_per_group, dim=-2)
            Ch = C[:, 0].float().repeat_interleave(heads_per_group, dim=-2)
            state["ssm"] = ssd_step(state["ssm"], x[:, 0].float(), dt[:, 0], A, Bh, Ch)
            y = torch.einsum("bhpn,bhn->bhp", state["ssm"], Ch) + x[:, 0].float() * p.D.float()[:, None]
            y = self.norm(y.reshape(-1, 1, p.d_inner).to(hidden_states.dtype), z, p.norm)
            outputs.append(local_linear(self.out_proj, y, p.out_proj))
        return torch.cat(outputs, dim=1)


def _mamba_states(cache: KVCache | None) -> dict[int, dict[str, torch.Tensor]] | None:
    """The per-layer Mamba states kept next to a ``KVCache``'s keys and values (created on first use)."""
    if cache is None:
        return None
    if not hasattr(cache, "mamba_states"):
        cache.mamba_states = {}
    return cache.mamba_states


def _pre_norm(layer: nn.Module, norm: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """A layer's pre-norm; of a float32 residual stream (``fp32_residual_connection``) in float32, cast to the
    parameters' dtype for the sub-layer (the residual itself stays float32, as in Megatron's MambaLayer)."""
    if layer.fp32_residual:
        return norm_residual(norm, hidden_states, layer.params_dtype)
    return norm(hidden_states)


class MambaLayer(nn.Module):
    """``x + drop(mixer(norm(x)))`` (Megatron's MambaLayer: the residual is always its input, whatever
    ``apply_residual_connection_post_layernorm`` says)."""

    def __init__(self, args: TransformerArgs, layer_number: int) -> None:
        super().__init__()
        self.layer_number = layer_number
        self.norm = build_norm(args, args.hidden_size)
        self.mixer = MambaMixer(args, layer_number)
        self.dropout = nn.Dropout(args.hidden_dropout)
        self.fp32_residual, self.params_dtype = args.fp32_residual_connection, args.params_dtype

    def forward(self, hidden_states: torch.Tensor, rotary: Any = None, attention_mask: Any = None, *,
                kv_cache: KVCache | None = None) -> torch.Tensor:
        normed = _pre_norm(self, self.norm, hidden_states)
        return hidden_states + self.dropout(self.mixer(normed, kv_cache))


class AttentionLayer(nn.Module):
    """A hybrid stack's attention layer: ``x + drop(attn(norm(x)))`` (no MLP, as in Megatron's hybrid), or
    ``norm(x) + drop(attn(norm(x)))`` with ``apply_residual_connection_post_layernorm`` (Megatron builds it as a
    TransformerLayer, which honours the flag). Its ``self_attention.window`` is the layer's sliding window
    (``layer_windows`` by its index in the whole hybrid stack, as Megatron numbers it)."""

    def __init__(self, args: TransformerArgs, layer_number: int) -> None:
        super().__init__()
        self.layer_number = layer_number
        self.input_layernorm = build_norm(args, args.hidden_size)
        self.self_attention = SelfAttention(args, layer_number)
        self.self_attn_dropout = nn.Dropout(args.hidden_dropout)
        self.fp32_residual, self.params_dtype = args.fp32_residual_connection, args.params_dtype
        self.residual_post_norm = args.apply_residual_connection_post_layernorm

    def forward(self, hidden_states: torch.Tensor, rotary: Any = None, attention_mask: Any = None, *,
                kv_cache: KVCache | None = None) -> torch.Tensor:
        normed = _pre_norm(self, self.input_layernorm, hidden_states)
        attn = self.self_attention(normed, rotary, attention_mask, kv_cache=kv_cache)
        residual = sublayer_residual(hidden_states, normed, self.residual_post_norm, self.fp32_residual)
        return residual + self.self_attn_dropout(attn)


class MLPLayer(nn.Module):
    """A hybrid stack's MLP ('-') or MoE ('E') layer: ``x + drop(mlp(norm(x)))`` (``norm(x) + ...`` with
    ``apply_residual_connection_post_layernorm``, as the attention layer)."""

    def __init__(self, args: TransformerArgs, layer_number: int, moe: bool) -> None:
        super().__init__()
        self.layer_number = layer_number
        self.pre_mlp_layernorm = build_norm(args, args.hidden_size)
        self.mlp: nn.Module = MoELayer(args, layer_number) if moe else MLP(args)
        self.mlp_dropout = nn.Dropout(args.hidden_dropout)
        self.fp32_residual, self.params_dtype = args.fp32_residual_connection, args.params_dtype
        self.residual_post_norm = args.apply_residual_connection_post_layernorm

    def forward(self, hidden_states: torch.Tensor, rotary: Any = None, attention_mask: Any = None, *,
                kv_cache: KVCache | None = None) -> torch.Tensor:
        normed = _pre_norm(self, self.pre_mlp_layernorm, hidden_states)
        residual = sublayer_residual(hidden_states, normed, self.residual_post_norm, self.fp32_residual)
        return residual + self.mlp_dropout(self.mlp(normed))


def build_layer(args: TransformerArgs, layer_number: int) -> nn.Module:
    """The layer the pattern names at ``layer_number``."""
    kind = args.layer_types[layer_number]
    if kind == MAMBA:
        return MambaLayer(args, layer_number)
    if kind == ATTENTION:
        return AttentionLayer(args, layer_number)
    return MLPLayer(args, layer_number, moe=kind == MOE)


class MambaStack(nn.Module):
    """``layers`` keyed by global layer index (as ``TransformerBlock``) and, on the last stage, ``final_norm``."""

    def __init__(self, args: TransformerArgs, layer_numbers: list[int] | None = None, post_process: bool = True):
        super().__init__()
        numbers = range(args.num_layers) if layer_numbers is None else layer_numbers
        self.layers = nn.ModuleDict({str(i): build_layer(args, i) for i in numbers})
        self.final_norm = build_norm(args, args.hidden_size) if post_process else None
        self.fp32_residual, self.params_dtype = args.fp32_residual_connection, args.params_dtype

    def forward(self, hidden_states: torch.Tensor, rotary: Any, attention_mask: torch.Tensor | None, *,
                kv_cache: KVCache | None = None) -> torch.Tensor:
        if self.fp32_residual:  # Megatron casts the embeddings' output; a later stage receives float32 already
            hidden_states = hidden_states.float()
        layers = list(self.layers.values())
        # sliding-window attention layers share one per-forward mask per window (Mamba / MLP layers ignore theirs)
        for layer, mask in zip(layers, layer_masks(layers, attention_mask)):
            hidden_states = layer(hidden_states, rotary, mask, kv_cache=kv_cache)
        if self.final_norm is not None:
            hidden_states = _pre_norm(self, self.final_norm, hidden_states)
        return hidden_states


class MambaModel(DecoderLanguageModel):
    """Mamba / hybrid language model (Megatron Core's MambaModel in plain PyTorch); see ``GPTModel`` for the
    arguments and the forward contract, which are the same (``DecoderLanguageModel``'s, around a
    ``MambaStack``). The loss is always the plain output layer + cross-entropy: no ``linear_cross_entropy``."""

    def __init__(self, config: MambaProvider, pre_process: bool = True, post_process: bool = True,
                 vp_stage: int | None = None, layer_numbers: list[int] | None = None) -> None:
        super().__init__(config, resolve_mamba_args(config), pre_process, post_process, vp_stage)
        self.decoder = MambaStack(self.args, layer_numbers, post_process)
        self.output_layer = self.build_output_layer()


def build_mamba_model(provider: MambaProvider, pre_process: bool = True, post_process: bool = True,
                      vp_stage: int | None = None, *, seed: int | None = None, materialize: bool = True,
                      layer_numbers: list[int] | None = None) -> MambaModel:
    """Build a ``MambaModel`` on the meta device and (by default) materialize and initialize it from ``seed``
    (default ``torch.initial_seed()``), exactly as ``build_gpt_model`` does."""
    with torch.device("meta"):
        model = MambaModel(provider, pre_process, post_process, vp_stage, layer_numbers)
    return materialize_model(model, provider, seed) if materialize else model
