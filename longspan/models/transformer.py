"""Building blocks of the decoder: norms, self-attention, MLP, transformer layer and block.

Plain PyTorch modules with Megatron Core's names, written so that tensor-parallel plans (applied later by
``longspan.parallel``) are plain column/row-wise splits of ``nn.Linear`` modules:

- q, k and v are separate ``nn.Linear`` modules and attention reads its local head counts from the projected
  shapes (``view(b, s, -1, head_dim)``), so column-sharded projections work unchanged;
- the gated MLP keeps gate and up projections apart (``linear_fc1_gate`` and ``linear_fc1``).

Every ``nn.Linear``/``nn.Embedding`` carries an ``init_std`` attribute read by ``longspan.models.init``.
Hidden states are ``[batch, seq, hidden]`` throughout. ``config`` here is the resolved namespace from
``longspan.models.args.TransformerArgs`` (checked by the model rules, derived defaults filled in).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from longspan.core.errors import ConfigError
from longspan.models.args import T5Args, TransformerArgs
from longspan.models.activations import gated_activation
from longspan.models.attention import core_attention, low_precision_softmax_attention, softcapped_core_attention
from longspan.models.attention_sinks import sink_core_attention
from longspan.models.gated_delta_net import GatedDeltaNet
from longspan.models.gated_delta_rule import DocumentLayout
from longspan.models.mla import MLASelfAttention
from longspan.models.moe import MoELayer
from longspan.models.rope import apply_rotary, signed_sin
from longspan.models.sliding_window import TwoSidedMask, WindowedMask

RotaryTables = tuple[torch.Tensor, torch.Tensor]


class KVCache:
    """Keys and values of the tokens seen so far, per layer, for incremental decoding (generation).

    A full-attention layer's keys and values are preallocated ``[batch, kv_heads, max_seq_len, head_dim]`` on
    its first update. A sliding-window layer (``update(..., window=w)``) keeps only its ``w - 1`` most recent
    positions (all a later token can see besides itself), so its memory is bounded by the window whatever the
    sequence length. A multi-latent attention layer (``update_latent``) keeps its compressed latent and shared
    rotary key instead (``kv_lora_rank + qk_pos_emb_head_dim`` numbers per token). A gated DeltaNet layer
    (``longspan.models.gated_delta_net``) keeps no keys: its conv window's tail and its recurrent state are its
    ``linear_states`` entry, a fixed size whatever the sequence length. ``seq_len`` counts the
    positions seen: ``GPTModel.forward(..., kv_cache=cache)`` numbers
    new tokens from it (RoPE and learned positions), masks attention causally from it, and advances it after
    the forward.
    """

    def __init__(self, max_seq_len: int) -> None:
        self.max_seq_len = int(max_seq_len)
        self.seq_len = 0
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        # multi-latent attention layers: [batch, max_seq_len, kv_lora_rank + qk_pos_emb_head_dim] per layer
        self.latents: dict[int, torch.Tensor] = {}
        # gated DeltaNet layers: {"conv": [b, conv channels, conv_kernel - 1], "state": [b, value_heads, dk, dv]}
        self.linear_states: dict[int, dict[str, torch.Tensor]] = {}
        # mRoPE models (longspan.models.vlm): the prompt's position shift [b, 1] the tokens after it continue with
        self.rope_deltas: torch.Tensor | None = None

    def update(
        self, layer_number: int, k: torch.Tensor, v: torch.Tensor, window: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new ``k``/``v`` ``[b, kv_heads, s, d]`` of one layer; return its keys and values: all of
        them, or for a sliding-window layer the kept ones then the new ones (the last key is always the last new
        token's, as ``longspan.models.sliding_window`` expects)."""
        start, end = self.seq_len, self.seq_len + k.shape[2]
        if end > self.max_seq_len:
            raise ValueError(f"KVCache holds at most {self.max_seq_len} positions; {end} were asked for")
        if window is not None:
            return self._update_window(layer_number, k, v, window)
        if layer_number not in self.keys:
            shape = (k.shape[0], k.shape[1], self.max_seq_len, k.shape[3])
            self.keys[layer_number] = k.new_empty(shape)
            self.values[layer_number] = v.new_empty(shape[:3] + (v.shape[3],))  # values may be narrower
        self.keys[layer_number][:, :, start:end] = k
        self.values[layer_number][:, :, start:end] = v
        return self.keys[layer_number][:, :, :end], self.values[layer_number][:, :, :end]

    def update_latent(
        self, layer_number: int, latent: torch.Tensor, k_pe: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A multi-latent attention layer's cache: store the new tokens' normed latent ``[b, s, kv_lora_rank]``
        and rotated shared key ``[b, s, 1, qk_pos_emb_head_dim]`` side by side in one preallocated
        ``[b, max_seq_len, kv_lora_rank + qk_pos_emb_head_dim]`` tensor; return both for every position so far."""
        start, end = self.seq_len, self.seq_len + latent.shape[1]
        if end > self.max_seq_len:
            raise ValueError(f"KVCache holds at most {self.max_seq_len} positions; {end} were asked for")
        rank = latent.shape[-1]
        if layer_number not in self.latents:
            shape = (latent.shape[0], self.max_seq_len, rank + k_pe.shape[-1])
            self.latents[layer_number] = latent.new_empty(shape)
        store = self.latents[layer_number]
        store[:, start:end, :rank] = latent
        store[:, start:end, rank:] = k_pe.squeeze(2)
        return store[:, :end, :rank], store[:, :end, None, rank:]

    def nbytes(self) -> int:
        """Bytes the cache holds (keys, values, latents and linear-attention states of every layer)."""
        tensors = [*self.keys.values(), *self.values.values(), *self.latents.values()]
        tensors += [t for state in self.linear_states.values() for t in state.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def _update_window(
        self, layer_number: int, k: torch.Tensor, v: torch.Tensor, window: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = k, v
        if layer_number in self.keys:
            keys = torch.cat([self.keys[layer_number], k], dim=2)
            values = torch.cat([self.values[layer_number], v], dim=2)
        keep = min(window - 1, keys.shape[2])
        # copies: a slice would hold on to the whole prompt's keys
        self.keys[layer_number] = keys[:, :, keys.shape[2] - keep:].clone()
        self.values[layer_number] = values[:, :, values.shape[2] - keep:].clone()
        return keys, values

    def causal_mask(self, new_tokens: int, device: torch.device) -> torch.Tensor:
        """Megatron's bool mask (True = masked) ``[1, 1, new, cached + new]``: token i sees keys up to its position."""
        total = self.seq_len + new_tokens
        ones = torch.ones(new_tokens, total, dtype=torch.bool, device=device)
        return ones.triu(diagonal=self.seq_len + 1)[None, None]


class _RMSNormFunction(torch.autograd.Function):
    """``weight * rms_norm(x.float()).to(x.dtype)`` with a hand-written backward: 7 kernels instead of the ~14
    that autograd runs through the composite ``F.rms_norm`` (pow, mean, rsqrt, mul and their backwards)."""

    @staticmethod
    def forward(ctx, x, weight, eps):  # type: ignore[override]
        x32 = x.float()
        rstd = x32.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
        normed = x32 * rstd
        ctx.save_for_backward(normed, rstd, weight)
        return weight * normed.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        normed, rstd, weight = ctx.saved_tensors
        grad_weight = None
        if ctx.needs_input_grad[1]:
            prod = grad_out * normed.to(grad_out.dtype)
            grad_weight = prod.reshape(-1, prod.shape[-1]).sum(0).to(weight.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_normed = grad_out.float() * weight.float()
            # d/dx of x * rstd(x): rstd * (g - normed * mean(g * normed))
            dot = (grad_normed * normed).mean(-1, keepdim=True)
            grad_x = torch.addcmul(grad_normed * rstd, normed, dot * rstd, value=-1.0).to(grad_out.dtype)
        return grad_x, grad_weight, None


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32 (as HF Llama and Transformer Engine do), cast back after.

    With ``zero_centered_gamma`` the weight stores ``gamma - 1`` (Megatron's layernorm_zero_centered_gamma,
    HF Gemma's norms): the output is ``normed * (1 + w)`` with the product in float32, cast back after.
    """

    def __init__(self, dim: int, eps: float = 1e-5, dtype: torch.dtype | None = None,
                 zero_centered_gamma: bool = False) -> None:
        super().__init__()
        self.normalized_shape = (dim,)
        self.eps = eps
        self.zero_centered_gamma = zero_centered_gamma
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))
        if zero_centered_gamma:
            self.init_rule = ("zeros", 0.0)  # gamma = 1 + w starts at one

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.zero_centered_gamma:
            gamma = 1.0 + self.weight.float()
            if type(x) is torch.Tensor and type(self.weight) is nn.Parameter:
                return _RMSNormFunction.apply(x.float(), gamma, self.eps).to(x.dtype)
            return (gamma * F.rms_norm(x.float(), self.normalized_shape, eps=self.eps)).to(x.dtype)
        if type(x) is torch.Tensor and type(self.weight) is nn.Parameter:
            return _RMSNormFunction.apply(x, self.weight, self.eps)
        # DTensors (sequence / tensor parallel): the composite form, which DTensor's op rules cover.
        normed = F.rms_norm(x.float(), self.normalized_shape, eps=self.eps)
        return self.weight * normed.to(x.dtype)


class ZeroCenteredLayerNorm(nn.LayerNorm):
    """LayerNorm whose weight stores ``gamma - 1`` (Megatron's layernorm_zero_centered_gamma); starts at zero."""

    def __init__(self, dim: int, eps: float = 1e-5, dtype: torch.dtype | None = None) -> None:
        super().__init__(dim, eps=eps, dtype=dtype)
        self.init_rule = {"weight": ("zeros", 0.0), "bias": ("zeros", 0.0)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight + 1, self.bias, self.eps)


def build_norm(config: TransformerArgs | T5Args, dim: int) -> nn.Module:
    """The norm named by ``config.normalization`` ('LayerNorm' or 'RMSNorm') over ``dim`` channels, zero-centred
    when ``config.layernorm_zero_centered_gamma``."""
    centred = bool(config.layernorm_zero_centered_gamma)
    if config.normalization == "LayerNorm":
        if centred:
            return ZeroCenteredLayerNorm(dim, eps=config.layernorm_epsilon, dtype=config.params_dtype)
        return nn.LayerNorm(dim, eps=config.layernorm_epsilon, dtype=config.params_dtype)
    if config.normalization == "RMSNorm":
        return RMSNorm(dim, eps=config.layernorm_epsilon, dtype=config.params_dtype, zero_centered_gamma=centred)
    raise ConfigError(f"model.normalization={config.normalization!r}: expected 'LayerNorm' or 'RMSNorm'")


def _linear(in_features: int, out_features: int, bias: bool, std: float, dtype: torch.dtype) -> nn.Linear:
    layer = nn.Linear(in_features, out_features, bias=bias, dtype=dtype)
    layer.init_std = std  # read by init_weights
    return layer


class SelfAttention(nn.Module):
    """Multi-head / grouped-query self-attention with optional per-head QK norm and RoPE.

    Parameters: ``linear_q`` [heads*d, hidden], ``linear_k`` / ``linear_v`` [groups*d, hidden], ``linear_proj``
    [hidden, heads*d], with ``qk_layernorm`` ``q_layernorm`` / ``k_layernorm`` over ``d`` channels, and with
    ``attention_output_gate`` ``linear_gate`` [heads*d, hidden]: the attention output is multiplied by
    ``sigmoid(linear_gate(x))`` before ``linear_proj`` (Qwen3-Next / Qwen3.5's gated attention).
    """

    # Sliding window: the positions each token attends to, itself included (HF's sliding_window); None: full
    # causal attention. Set per layer from ``layer_windows``.
    window: int | None = None

    def __init__(self, config: TransformerArgs, layer_number: int) -> None:
        super().__init__()
        self.layer_number = layer_number
        heads = config.num_attention_heads
        groups = config.num_query_groups or heads
        self.head_dim = config.kv_channels or config.hidden_size // heads
        qkv_bias = bool(config.add_bias_linear or config.add_qkv_bias)
        std = config.init_method_std
        out_std = std / math.sqrt(2.0 * config.num_layers)
        dtype = config.params_dtype
        hidden = config.hidden_size
        self.linear_q = _linear(hidden, heads * self.head_dim, qkv_bias, std, dtype)
        self.linear_gate = (_linear(hidden, heads * self.head_dim, qkv_bias, std, dtype)
                            if config.attention_output_gate else None)
        self.linear_k = _linear(hidden, groups * self.head_dim, qkv_bias, std, dtype)
        self.linear_v = _linear(hidden, groups * self.head_dim, qkv_bias, std, dtype)
        self.linear_proj = _linear(heads * self.head_dim, hidden, config.add_bias_linear, out_std, dtype)
        # Per head (Qwen3, Gemma 3), or across heads over the whole projection (OLMo-2)
        self.qk_norm_across_heads = bool(config.qk_layernorm_across_heads)
        if config.qk_layernorm:
            q_dim, k_dim = (heads * self.head_dim, groups * self.head_dim) if self.qk_norm_across_heads else \
                (self.head_dim, self.head_dim)
            self.q_layernorm = build_norm(config, q_dim)
            self.k_layernorm = build_norm(config, k_dim)
        else:
            self.q_layernorm = None
            self.k_layernorm = None
        self.attention_dropout = config.attention_dropout
        self.softmax_scale = config.softmax_scale
        self.rotary_interleaved = bool(config.rotary_interleaved)
        windows = config.layer_windows
        self.window: int | None = windows[layer_number] if windows else None
        # Set by the decoder for recompute_granularity='selective': recompute the attention core only.
        self.recompute_core_attention = False
        # The attention core (same signature as ``core_attention``); parallel plans may swap it, e.g. context
        # parallel's all-gather attention (longspan.parallel.context_parallel).
        self.core_attention: Callable[..., torch.Tensor] = (
            core_attention if config.attention_softmax_in_fp32 else low_precision_softmax_attention
        )
        softcap = config.attn_logit_softcapping
        if softcap:
            self.core_attention = functools.partial(softcapped_core_attention, softcap=float(softcap))
        # Attention sinks (softmax_type): one extra softmax logit per head, learned ('learnable', GPT-OSS's
        # sinks) or fixed at zero ('off-by-one').
        softmax_type = config.softmax_type
        self.softmax_offset: nn.Parameter | None = None
        if softmax_type == "learnable":
            self.softmax_offset = nn.Parameter(torch.empty(heads, dtype=dtype))
            self.init_rule = {"softmax_offset": ("zeros", 0.0)}
        if softmax_type != "vanilla":
            self.core_attention = self._sink_attention

    def _sink_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_mask: Any,
                        dropout_p: float, scale: float | None) -> torch.Tensor:
        offset = self.softmax_offset
        if offset is None:  # 'off-by-one': a zero logit
            sinks = q.new_zeros(q.shape[1])
        else:  # this process's heads (tensor parallel shards them with the projections)
            to_local = getattr(offset, "to_local", None)
            sinks = to_local() if callable(to_local) else offset
        return sink_core_attention(q, k, v, attention_mask, dropout_p, scale, sinks=sinks)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_mask: Any) -> torch.Tensor:
        """Core attention of ``[b, heads, s, d]`` queries, keys and values (the layer's window, dropout in
        training, recomputed in backward when ``recompute_core_attention``), ``[b, heads, s, d_v]`` out."""
        if self.window is not None and not isinstance(attention_mask, WindowedMask):
            # called without the decoder's per-forward masks (a layer on its own, a hybrid stack)
            attention_mask = WindowedMask(self.window, attention_mask)
        dropout_p = self.attention_dropout if self.training else 0.0
        if self.recompute_core_attention and torch.is_grad_enabled():
            return checkpoint(
                self.core_attention, q, k, v, attention_mask, dropout_p, self.softmax_scale, use_reentrant=False
            )
        return self.core_attention(q, k, v, attention_mask, dropout_p, self.softmax_scale)

    def forward(
        self,
        hidden_states: torch.Tensor,
        rotary: RotaryTables | None = None,
        attention_mask: torch.Tensor | None = None,
        *,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        b, s, _ = hidden_states.shape
        q, k = self.linear_q(hidden_states), self.linear_k(hidden_states)
        if self.q_layernorm is not None and self.qk_norm_across_heads:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        # -1 heads: under tensor parallel the projections are column-sharded and hold only local heads.
        q = q.view(b, s, -1, self.head_dim)
        k = k.view(b, s, -1, self.head_dim)
        v = self.linear_v(hidden_states).view(b, s, -1, self.head_dim)
        if self.q_layernorm is not None and not self.qk_norm_across_heads:
            q = self.q_layernorm(q)
            k = self.k_layernorm(k)
        if rotary is not None:
            cos, sin = rotary
            if self.rotary_interleaved:
                q = apply_rotary(q, cos, sin, interleaved=True)
                k = apply_rotary(k, cos, sin, interleaved=True)
            else:
                sin_signed = signed_sin(sin)  # shared by queries and keys
                q = apply_rotary(q, cos, sin, sin_signed=sin_signed)
                k = apply_rotary(k, cos, sin, sin_signed=sin_signed)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_number, k, v, window=self.window)
        out = self.attend(q, k, v, attention_mask).transpose(1, 2).reshape(b, s, -1)
        if self.linear_gate is not None:
            out = out * torch.sigmoid(self.linear_gate(hidden_states))
        return self.linear_proj(out)


class MLP(nn.Module):
    """Feed-forward block: ``fc2(act(fc1(x)))``, or gated ``fc2(act(fc1_gate(x)) * fc1(x))`` (SwiGLU/GeGLU).

    Megatron Core fuses gate and up into one ``linear_fc1`` whose first half is the gate; longspan keeps them
    apart (``linear_fc1_gate`` = first half, ``linear_fc1`` = second half) so tensor parallel is a plain split.
    """

    def __init__(self, config: TransformerArgs | T5Args) -> None:
        super().__init__()
        std = config.init_method_std
        out_std = std / math.sqrt(2.0 * config.num_layers)
        dtype = config.params_dtype
        ffn = config.ffn_hidden_size
        bias = config.add_bias_linear
        self.linear_fc1 = _linear(config.hidden_size, ffn, bias, std, dtype)
        self.linear_fc1_gate = _linear(config.hidden_size, ffn, bias, std, dtype) if config.gated_linear_unit else None
        self.linear_fc2 = _linear(ffn, config.hidden_size, bias, out_std, dtype)
        self.activation_func: Callable[[torch.Tensor], torch.Tensor] = config.activation_func
        # GPT-OSS's gated MLP offset and clamp (T5 has neither)
        self.glu_linear_offset = 0.0
        self.activation_func_clamp_value: float | None = None
        if isinstance(config, TransformerArgs):
            self.glu_linear_offset = float(config.glu_linear_offset)
            self.activation_func_clamp_value = config.activation_func_clamp_value

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        up = self.linear_fc1(hidden_states)
        if self.linear_fc1_gate is not None:
            h = gated_activation(self.linear_fc1_gate(hidden_states), up, self.activation_func,
                                 self.glu_linear_offset, self.activation_func_clamp_value)
        else:
            h = self.activation_func(up)
        return self.linear_fc2(h)


def norm_residual(norm: nn.Module, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``norm(x)`` of a float32 residual stream (``fp32_residual_connection``) with parameters in ``dtype``:
    normalized in float32, cast to ``dtype`` for the layer it feeds."""
    if isinstance(norm, nn.LayerNorm):  # torch's CPU LayerNorm takes no float32 input with bf16/fp16 params
        bias = norm.bias.float() if norm.bias is not None else None
        out = F.layer_norm(x, norm.normalized_shape, norm.weight.float(), bias, norm.eps)
    else:
        out = norm(x)  # RMSNorm normalizes in float32 already
    return out.to(dtype)


def sublayer_residual(x: torch.Tensor, normed: torch.Tensor, post_norm: bool, fp32: bool) -> torch.Tensor:
    """What a sub-layer's output is added to: its input ``x``, or with ``apply_residual_connection_post_layernorm``
    (``post_norm``) its norm's output ``normed``; in float32 with ``fp32_residual_connection`` (``fp32``)."""
    residual = normed if post_norm else x
    return residual.float() if fp32 else residual


@dataclass
class LocalGlobalRotary:
    """The rotary tables of a model whose sliding-window (local) layers have their own RoPE base (Gemma 3):
    each layer picks its own (``TransformerLayer.uses_local_rope``)."""

    global_tables: RotaryTables
    local_tables: RotaryTables


def _optional_norm(config: TransformerArgs, wanted: bool) -> nn.Module | None:
    return build_norm(config, config.hidden_size) if wanted else None


class TransformerLayer(nn.Module):
    """Transformer layer: ``x + drop(post(attn(pre(x))))`` then ``x + drop(post(mlp(pre(x))))``.

    ``pre`` are ``input_layernorm`` / ``pre_mlp_layernorm`` (the usual pre-norm; absent without
    ``layernorm_before_sublayers``: OLMo-2), ``post`` are ``post_self_attn_layernorm`` / ``post_mlp_layernorm``
    (with ``layernorm_after_sublayers``: Gemma 2/3's extra norms, OLMo-2's only ones), identity otherwise.
    ``apply_residual_connection_post_layernorm`` adds each sub-layer's output to its normalized input instead
    (``pre(x) + drop(post(attn(pre(x))))``); ``fp32_residual_connection`` keeps ``x`` and the sums in float32.

    ``self_attention`` is ``longspan.models.mla.MLASelfAttention`` when the model has multi-latent attention
    (``config.mla``), ``longspan.models.gated_delta_net.GatedDeltaNet`` on the layers ``linear_attention_freq``
    marks (``config.gated_delta_net``), else ``SelfAttention``. ``mlp`` is a ``longspan.models.moe.MoELayer`` on
    the layers ``moe_layer_freq`` marks (when the model has experts), else the dense ``MLP``.
    """

    def __init__(self, config: TransformerArgs, layer_number: int) -> None:
        super().__init__()
        self.layer_number = layer_number
        before = config.layernorm_before_sublayers
        after = config.layernorm_after_sublayers
        self.input_layernorm = _optional_norm(config, before)
        linear = config.gated_delta_net
        self.linear_attention = linear is not None and linear.layer_flags[layer_number]
        if self.linear_attention:
            self.self_attention: nn.Module = GatedDeltaNet(config, layer_number)
        elif config.mla is not None:
            core = core_attention if config.attention_softmax_in_fp32 else low_precision_softmax_attention
            self.self_attention = MLASelfAttention(config, layer_number, core, build_norm)
        else:
            self.self_attention = SelfAttention(config, layer_number)
        self.post_self_attn_layernorm = _optional_norm(config, after)
        self.self_attn_dropout = nn.Dropout(config.hidden_dropout)
        self.pre_mlp_layernorm = _optional_norm(config, before)
        moe = config.moe
        if moe is not None and moe.layer_flags[layer_number]:
            self.mlp: nn.Module = MoELayer(config, layer_number)
        else:
            self.mlp = MLP(config)
        self.post_mlp_layernorm = _optional_norm(config, after)
        self.mlp_dropout = nn.Dropout(config.hidden_dropout)
        self.residual_post_norm = bool(config.apply_residual_connection_post_layernorm)
        self.fp32_residual = bool(config.fp32_residual_connection)
        self.params_dtype = config.params_dtype
        self.uses_local_rope = uses_local_rope(config, layer_number)

    def _norm(self, norm: nn.Module | None, x: torch.Tensor) -> torch.Tensor:
        if norm is None:  # no pre-norm (OLMo-2): the sub-layer reads the residual stream itself
            return x.to(self.params_dtype) if self.fp32_residual else x
        return norm_residual(norm, x, self.params_dtype) if self.fp32_residual else norm(x)

    def _residual(self, x: torch.Tensor, normed: torch.Tensor) -> torch.Tensor:
        return sublayer_residual(x, normed, self.residual_post_norm, self.fp32_residual)

    def forward(
        self,
        hidden_states: torch.Tensor,
        rotary: RotaryTables | LocalGlobalRotary | None = None,
        attention_mask: torch.Tensor | None = None,
        *,
        kv_cache: KVCache | None = None,
        cu_seqlens: torch.Tensor | DocumentLayout | None = None,
    ) -> torch.Tensor:
        """``cu_seqlens`` (packed documents' boundaries, or their ``DocumentLayout``) reaches a gated DeltaNet
        mixer only: attention keeps its documents apart by ``attention_mask``."""
        if isinstance(rotary, LocalGlobalRotary):
            rotary = rotary.local_tables if self.uses_local_rope else rotary.global_tables
        normed = self._norm(self.input_layernorm, hidden_states)
        documents = {"cu_seqlens": cu_seqlens} if self.linear_attention else {}
        attn = self.self_attention(normed, rotary, attention_mask, kv_cache=kv_cache, **documents)
        if self.post_self_attn_layernorm is not None:
            attn = self.post_self_attn_layernorm(attn)
        hidden_states = self._residual(hidden_states, normed) + self.self_attn_dropout(attn)
        normed = self._norm(self.pre_mlp_layernorm, hidden_states)
        mlp = self.mlp(normed)
        if self.post_mlp_layernorm is not None:
            mlp = self.post_mlp_layernorm(mlp)
        return self._residual(hidden_states, normed) + self.mlp_dropout(mlp)


def uses_local_rope(config: TransformerArgs, layer_number: int) -> bool:
    """Whether layer ``layer_number`` rotates with the local base: the model has one (a ``[local, global]``
    rotary_base) and the layer attends within a sliding window."""
    if config.rotary_base_local is None:
        return False
    windows = config.layer_windows
    return bool(windows) and windows[layer_number] is not None


class TransformerBlock(nn.Module):
    """The decoder: ``layers`` keyed by global layer index (a ``ModuleDict``) and, on the last pipeline stage,
    ``final_layernorm``.

    Keys are the global indices ("0", "1", ...), so parameter names match the unpipelined model whichever layers
    a stage keeps; the pipeline layer may delete entries (``del block.layers["3"]``) and forward runs whatever
    remains, in key order of insertion.

    Activation recomputation (Megatron semantics, per pipeline stage): ``'full'`` + ``'uniform'`` checkpoints
    consecutive chunks of ``recompute_num_layers`` layers; ``'full'`` + ``'block'`` checkpoints each of the first
    ``recompute_num_layers`` layers; ``'selective'`` recomputes only the attention core (SDPA).
    ``recompute_all_layers`` (set per microbatch by the pipeline schedule from
    ``partial_checkpoint_microbatches``, Megatron's ``num_microbatches_with_partial_activation_checkpoints``)
    makes ``'block'`` checkpoint every layer of the stage for that microbatch.
    """

    def __init__(
        self, config: TransformerArgs, layer_numbers: list[int] | None = None, post_process: bool = True
    ) -> None:
        super().__init__()
        numbers = range(config.num_layers) if layer_numbers is None else layer_numbers
        self.layers = nn.ModuleDict({str(i): TransformerLayer(config, i) for i in numbers})
        self.final_layernorm = build_norm(config, config.hidden_size) if post_process else None
        self.recompute_granularity = config.recompute_granularity
        self.recompute_method = config.recompute_method
        self.recompute_num_layers = config.recompute_num_layers
        self.partial_checkpoint_microbatches = config.partial_checkpoint_microbatches
        self.recompute_all_layers = False
        self.fp32_residual = bool(config.fp32_residual_connection)
        self.params_dtype = config.params_dtype
        if self.recompute_granularity == "selective":
            for layer in self.layers.values():
                layer.self_attention.recompute_core_attention = True

    def forward(
        self,
        hidden_states: torch.Tensor,
        rotary: RotaryTables | LocalGlobalRotary | None = None,
        attention_mask: torch.Tensor | None = None,
        *,
        kv_cache: KVCache | None = None,
        cu_seqlens: torch.Tensor | DocumentLayout | None = None,
    ) -> torch.Tensor:
        """``cu_seqlens``: packed documents' boundaries, for the gated DeltaNet layers (see ``TransformerLayer``);
        where each document's tokens are is worked out once here for all of them."""
        layers = list(self.layers.values())
        linear = any(getattr(layer, "linear_attention", False) for layer in layers)  # wrapped layers forward it
        if linear and isinstance(cu_seqlens, torch.Tensor):
            cu_seqlens = DocumentLayout.from_cu_seqlens(cu_seqlens, hidden_states.shape[0], hidden_states.shape[1])
        if self.fp32_residual:  # Megatron casts the embeddings' output; a later stage receives float32 already
            hidden_states = hidden_states.float()
        masks = layer_masks(layers, attention_mask)
        if self.recompute_granularity == "full" and torch.is_grad_enabled() and kv_cache is None:
            hidden_states = self._forward_full_recompute(layers, hidden_states, rotary, masks, cu_seqlens)
        else:
            for layer, mask in zip(layers, masks):
                hidden_states = layer(hidden_states, rotary, mask, kv_cache=kv_cache, cu_seqlens=cu_seqlens)
        if self.final_layernorm is not None:
            if self.fp32_residual:
                return norm_residual(self.final_layernorm, hidden_states, self.params_dtype)
            hidden_states = self.final_layernorm(hidden_states)
        return hidden_states

    def _forward_full_recompute(
        self,
        layers: list[nn.Module],
        hidden_states: torch.Tensor,
        rotary: RotaryTables | None,
        masks: list[Any],
        cu_seqlens: torch.Tensor | DocumentLayout | None = None,
    ) -> torch.Tensor:
        n = self.recompute_num_layers

        def run(chunk: list[nn.Module], chunk_masks: list[Any]) -> Callable[..., torch.Tensor]:
            def forward_chunk(h: torch.Tensor, rot: RotaryTables | None) -> torch.Tensor:
                for layer, mask in zip(chunk, chunk_masks):
                    h = layer(h, rot, mask, cu_seqlens=cu_seqlens)
                return h

            return forward_chunk

        if self.recompute_method == "uniform":
            for start in range(0, len(layers), n):
                fn = run(layers[start : start + n], masks[start : start + n])
                hidden_states = checkpoint(fn, hidden_states, rotary, use_reentrant=False)
        else:  # 'block': the first n layers of this stage (all for this microbatch: recompute_all_layers)
            for index, (layer, mask) in enumerate(zip(layers, masks)):
                if index < n or self.recompute_all_layers:
                    hidden_states = checkpoint(layer, hidden_states, rotary, mask, use_reentrant=False,
                                               cu_seqlens=cu_seqlens)
                else:
                    hidden_states = layer(hidden_states, rotary, mask, cu_seqlens=cu_seqlens)
        return hidden_states


def layer_masks(layers: list[nn.Module], attention_mask: torch.Tensor | None) -> list[Any]:
    """The ``attention_mask`` argument of each layer: the caller's mask for full-attention layers (None keeps
    SDPA's causal fast path; a ``TwoSidedMask``'s tensor), and for sliding-window layers one ``WindowedMask``
    per distinct window (without its causal part for a ``TwoSidedMask``), sharing
    one memo, so each window's mask is built once per forward whatever the number of layers."""
    memo: dict[Any, torch.Tensor] = {}
    by_window: dict[int, WindowedMask] = {}
    masks: list[Any] = []
    causal = not isinstance(attention_mask, TwoSidedMask)
    full_layers = attention_mask
    if not causal:
        full_layers = attention_mask.full_layers if attention_mask.sliding_only else attention_mask.mask
        attention_mask = attention_mask.mask
    for layer in layers:
        window = getattr(getattr(layer, "self_attention", None), "window", None)
        if window is None:
            masks.append(full_layers)
            continue
        if window not in by_window:
            by_window[window] = WindowedMask(window, attention_mask, memo, causal=causal)
        masks.append(by_window[window])
    return masks
