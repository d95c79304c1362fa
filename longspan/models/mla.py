"""Multi-latent attention (MLA, DeepSeek-V2/V3), as megatron-core's ``MLASelfAttention`` in plain PyTorch.

Keys and values come from one low-rank latent per token instead of per-head projections of the hidden state:

- ``linear_kv_down_proj`` [kv_lora_rank + qk_pos_emb_head_dim, hidden] projects each token to its latent
  ``c_kv`` (normed by ``kv_layernorm``) and a single decoupled RoPE key ``k_pe`` shared by every head;
- ``linear_kv_up_proj`` [heads * (qk_head_dim + v_head_dim), kv_lora_rank] expands ``c_kv`` to each head's
  position-free key part and its value (per head: ``qk_head_dim`` key channels, then ``v_head_dim`` value ones);
- queries: ``linear_q_proj`` [heads * (qk_head_dim + qk_pos_emb_head_dim), hidden] without query compression
  (``q_lora_rank`` None), else ``linear_q_down_proj`` [q_lora_rank, hidden], ``q_layernorm``, and
  ``linear_q_up_proj`` [heads * (qk_head_dim + qk_pos_emb_head_dim), q_lora_rank];
- each head's key is ``[k_nope, k_pe]`` and query ``[q_nope, q_pe]``; only the ``_pe`` parts rotate;
- ``linear_proj`` [hidden, heads * v_head_dim] projects the heads' outputs back.

The latent norms ``q_layernorm`` / ``kv_layernorm`` exist when ``qk_layernorm`` is set (megatron-core's layer
spec: identity otherwise); DeepSeek's models have them. Their epsilon is the model's ``layernorm_epsilon`` unless
``mla_latent_layernorm_epsilon`` sets one of their own (transformers' fixed 1e-6).

RoPE: the rotary channels are stored as interleaved pairs (DeepSeek's layout, which megatron-core's MLA and
transformers' ``rope_interleave=True`` read the same way): they are de-interleaved (even channels, then odd)
and rotated in the rotate-half form. The softmax scale is ``mscale(rotary_scaling_factor, mscale_all_dim)^2 /
sqrt(qk_head_dim + qk_pos_emb_head_dim)`` (YaRN's attention temperature; 1 / sqrt(d) when mscale_all_dim is 0).

A KV cache (generation) stores the normed latent and the rotated ``k_pe`` per token (``kv_lora_rank +
qk_pos_emb_head_dim`` numbers) and re-expands keys and values from it at every step.

Tensor parallel splits heads: the up-projections (and ``linear_q_proj``) column-wise, ``linear_proj`` row-wise;
the down-projections and the latent norms are replicated. The forward reads local head counts from the
projected shapes (``view(b, s, -1, d)``) so sharded projections work unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from longspan.models.rope import apply_rotary

if TYPE_CHECKING:  # the arguments module imports this one
    from longspan.models.args import TransformerArgs


@dataclass
class MLAArgs:
    """A multi-latent attention layer's sizes (megatron-core's MLATransformerConfig names)."""

    q_lora_rank: Optional[int]
    kv_lora_rank: int
    qk_head_dim: int
    qk_pos_emb_head_dim: int
    v_head_dim: int
    softmax_scale: float
    latent_norm_epsilon: Optional[float] = None
    """The latent norms' epsilon; None: the model's layernorm_epsilon."""

    @property
    def q_head_dim(self) -> int:
        """Channels per query / key head: the position-free part, then the rotary part."""
        return self.qk_head_dim + self.qk_pos_emb_head_dim

    @property
    def cache_channels(self) -> int:
        """Numbers a KV cache keeps per token and layer: the latent and the shared rotary key."""
        return self.kv_lora_rank + self.qk_pos_emb_head_dim


def yarn_mscale(scale: float, mscale: float) -> float:
    """YaRN's attention temperature factor ``0.1 * mscale * ln(scale) + 1`` (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def mla_softmax_scale(qk_head_dim: int, qk_pos_emb_head_dim: int, rotary_scaling_factor: float,
                      mscale_all_dim: float) -> float:
    """megatron-core's MLA softmax scale: ``mscale(factor, mscale_all_dim)^2 / sqrt(q_head_dim)``."""
    mscale = yarn_mscale(rotary_scaling_factor, mscale_all_dim)
    return mscale * mscale / math.sqrt(qk_head_dim + qk_pos_emb_head_dim)


def _linear(in_features: int, out_features: int, bias: bool, std: float, dtype: torch.dtype) -> nn.Linear:
    layer = nn.Linear(in_features, out_features, bias=bias, dtype=dtype)
    layer.init_std = std  # read by init_weights
    return layer


def _unchanged(x: torch.Tensor) -> torch.Tensor:
    return x


def rotate_interleaved_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [..., rot_dim]`` whose channels are interleaved pairs: de-interleave (even channels, then odd),
    then the rotate-half rotation with tables ``[..., rot_dim]`` (``cat(freqs, freqs)``)."""
    x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
    return apply_rotary(x, cos, sin)


class MLASelfAttention(nn.Module):
    """Multi-latent self-attention (see the module docstring for the parameters and the maths).

    ``config`` is ``TransformerArgs`` with ``mla`` set. The attention core is ``core_attention`` (swappable by
    parallel plans as ``SelfAttention``'s); ``build_norm(config, dim)`` makes the latent norms (the model's
    ``normalization``); ``window`` is always None (no sliding window).
    """

    window: int | None = None

    def __init__(self, config: TransformerArgs, layer_number: int, core_attention: Callable[..., torch.Tensor],
                 build_norm: Callable[[Any, int], nn.Module]) -> None:
        super().__init__()
        mla: MLAArgs = config.mla
        self.layer_number = layer_number
        self.mla = mla
        heads = config.num_attention_heads
        hidden = config.hidden_size
        bias = False  # megatron-core's MLA projections are bias-free; only linear_proj follows add_bias_linear
        std = config.init_method_std
        out_std = std / math.sqrt(2.0 * config.num_layers)
        dtype = config.params_dtype
        q_out = heads * mla.q_head_dim
        latent_norms = config if mla.latent_norm_epsilon is None else \
            replace(config, layernorm_epsilon=mla.latent_norm_epsilon)
        if mla.q_lora_rank is None:
            self.linear_q_proj: nn.Linear | None = _linear(hidden, q_out, bias, std, dtype)
            self.linear_q_down_proj = self.q_layernorm = self.linear_q_up_proj = None
        else:
            self.linear_q_proj = None
            self.linear_q_down_proj = _linear(hidden, mla.q_lora_rank, bias, std, dtype)
            self.q_layernorm = build_norm(latent_norms, mla.q_lora_rank) if config.qk_layernorm else None
            self.linear_q_up_proj = _linear(mla.q_lora_rank, q_out, bias, std, dtype)
        self.linear_kv_down_proj = _linear(hidden, mla.cache_channels, bias, std, dtype)
        self.kv_layernorm = build_norm(latent_norms, mla.kv_lora_rank) if config.qk_layernorm else None
        self.linear_kv_up_proj = _linear(mla.kv_lora_rank, heads * (mla.qk_head_dim + mla.v_head_dim), bias, std,
                                         dtype)
        self.linear_proj = _linear(heads * mla.v_head_dim, hidden, bool(config.add_bias_linear), out_std, dtype)
        self.attention_dropout = config.attention_dropout
        self.softmax_scale = mla.softmax_scale
        self.recompute_core_attention = False
        self.core_attention = core_attention
        # Applied to the shared rotary key before it joins this module's heads. Identity here; a tensor-parallel
        # plan (which leaves each rank a share of the heads) swaps in an identity whose backward sums the key's
        # gradient over every rank's heads (longspan.parallel.tensor_parallel).
        self.shared_key: Callable[[torch.Tensor], torch.Tensor] = _unchanged

    def _queries(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.linear_q_proj is not None:
            return self.linear_q_proj(hidden_states)
        compressed = self.linear_q_down_proj(hidden_states)
        if self.q_layernorm is not None:
            compressed = self.q_layernorm(compressed)
        return self.linear_q_up_proj(compressed)

    def forward(
        self,
        hidden_states: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        *,
        kv_cache: Any = None,
    ) -> torch.Tensor:
        b, s, _ = hidden_states.shape
        mla = self.mla
        q = self._queries(hidden_states).view(b, s, -1, mla.q_head_dim)
        q_nope, q_pe = torch.split(q, [mla.qk_head_dim, mla.qk_pos_emb_head_dim], dim=-1)
        latent, k_pe = torch.split(self.linear_kv_down_proj(hidden_states),
                                   [mla.kv_lora_rank, mla.qk_pos_emb_head_dim], dim=-1)
        if self.kv_layernorm is not None:
            latent = self.kv_layernorm(latent)
        k_pe = k_pe.unsqueeze(2)  # [b, s, 1, pe]: one rotary key shared by all heads
        if rotary is not None:
            cos, sin = rotary
            q_pe = rotate_interleaved_pairs(q_pe, cos, sin)
            k_pe = rotate_interleaved_pairs(k_pe, cos, sin)
        if kv_cache is not None:
            latent, k_pe = kv_cache.update_latent(self.layer_number, latent, k_pe)
        k_pe = self.shared_key(k_pe)
        kv = self.linear_kv_up_proj(latent).view(b, latent.shape[1], -1, mla.qk_head_dim + mla.v_head_dim)
        k_nope, v = torch.split(kv, [mla.qk_head_dim, mla.v_head_dim], dim=-1)
        k = torch.cat((k_nope, k_pe.expand(-1, -1, k_nope.shape[2], -1)), dim=-1)
        q = torch.cat((q_nope, q_pe), dim=-1)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        dropout_p = self.attention_dropout if self.training else 0.0
        if self.recompute_core_attention and torch.is_grad_enabled():
            out = checkpoint(self.core_attention, q, k, v, attention_mask, dropout_p, self.softmax_scale,
                             use_reentrant=False)
        else:
            out = self.core_attention(q, k, v, attention_mask, dropout_p, self.softmax_scale)
        return self.linear_proj(out.transpose(1, 2).reshape(b, s, -1))

