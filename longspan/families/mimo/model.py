"""MiMo-V2-Flash (HF ``MiMoV2FlashForCausalLM``) on longspan's GPT blocks.

What differs from the GPT model (``longspan.models.gpt``), all chosen by ``MiMoV2FlashModelProvider``:

- each layer is built from its own ``TransformerArgs``: the sliding-window layers (``layer_windows``) take
  ``window_num_query_groups`` KV groups and ``window_softmax_type`` (learned attention sinks,
  ``self_attention.softmax_offset``), the full-attention layers the GPT fields;
- values are ``v_head_dim`` wide (queries and keys ``kv_channels``) and multiplied by ``attention_value_scale``
  before attention and the KV cache, as transformers does;
- RoPE: the GPT model's ``[local, global]`` rotary_base (sliding-window layers rotate with the local base),
  ``rotary_percent`` of every head's channels.

Module names stay the GPT model's (``decoder.layers.{i}.self_attention.linear_q`` ...), so the tensor parallel
plans (column-split q/k/v and sinks by heads, row-split ``linear_proj``), the MoE and the weight tables apply
unchanged.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
from torch import nn

from longspan.core.errors import ConfigError, NotSupportedError
from longspan.models.args import TransformerArgs
from longspan.models.gpt import DecoderLanguageModel, resolve_model_args
from longspan.models.init import materialize_model
from longspan.models.loss import linear_cross_entropy
from longspan.models.rope import apply_rotary, signed_sin
from longspan.models.transformer import KVCache, SelfAttention, TransformerBlock, TransformerLayer

SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")


def check_mimo_provider(provider: Any, args: TransformerArgs) -> None:
    """What longspan's MiMo-V2-Flash cannot build: one line naming the field."""
    heads = args.num_attention_heads
    groups = provider.window_num_query_groups or args.num_query_groups
    if groups <= 0 or heads % groups:
        raise ConfigError(f"model.window_num_query_groups={groups} must divide model.num_attention_heads={heads}")
    tp = int(provider.tensor_model_parallel_size or 1)
    if groups % tp:
        raise ConfigError(f"model.window_num_query_groups={groups} with tensor_model_parallel_size={tp}: tensor "
                          "parallel splits whole KV groups of the sliding-window layers; use a tp that divides it")
    softmax = provider.window_softmax_type or args.softmax_type
    if softmax not in SOFTMAX_TYPES:
        raise ConfigError(f"model.window_softmax_type={softmax!r}: use one of {', '.join(map(repr, SOFTMAX_TYPES))}")
    if softmax != "vanilla" and int(provider.context_parallel_size or 1) > 1:
        raise NotSupportedError(f"model.window_softmax_type={softmax!r} is not supported with "
                                "context_parallel_size > 1: use 'vanilla' or context_parallel_size=1")
    v_dim = provider.v_head_dim
    if v_dim is not None and (not isinstance(v_dim, int) or v_dim <= 0):
        raise ConfigError(f"model.v_head_dim={v_dim!r} must be a positive integer (or None: kv_channels)")
    scale = provider.attention_value_scale
    if scale is not None and not (isinstance(scale, (int, float)) and scale > 0):
        raise ConfigError(f"model.attention_value_scale={scale!r} must be a positive number (or None: 1)")
    for name in ("multi_latent_attention", "attention_output_gate", "qk_layernorm", "mtp_num_layers",
                 "experimental_attention_variant", "rotary_interleaved"):
        if getattr(provider, name, None):
            raise NotSupportedError(f"model.{name}={getattr(provider, name)!r} is not supported yet for "
                                    "MiMo-V2-Flash")


def mimo_layer_args(provider: Any, args: TransformerArgs) -> list[TransformerArgs]:
    """Each layer's arguments: the sliding-window layers' KV groups and softmax type, the others ``args``."""
    window = dataclasses.replace(args, num_query_groups=int(provider.window_num_query_groups or args.num_query_groups),
                                 softmax_type=provider.window_softmax_type or args.softmax_type)
    windows = args.layer_windows or [None] * args.num_layers
    return [args if w is None else window for w in windows]


class MiMoAttention(SelfAttention):
    """``SelfAttention`` with values of their own width (``linear_v`` ``[groups * v_head_dim, hidden]``,
    ``linear_proj`` ``[hidden, heads * v_head_dim]``) scaled by a constant."""

    def __init__(self, config: TransformerArgs, layer_number: int, v_head_dim: int,
                 value_scale: Optional[float]) -> None:
        super().__init__(config, layer_number)
        self.v_head_dim = v_head_dim
        self.value_scale = value_scale
        heads, groups = config.num_attention_heads, config.num_query_groups
        dtype = config.params_dtype
        v_std, proj_std = self.linear_v.init_std, self.linear_proj.init_std
        qkv_bias = self.linear_v.bias is not None
        self.linear_v = nn.Linear(config.hidden_size, groups * v_head_dim, bias=qkv_bias, dtype=dtype)
        self.linear_v.init_std = v_std
        self.linear_proj = nn.Linear(heads * v_head_dim, config.hidden_size, bias=bool(config.add_bias_linear),
                                     dtype=dtype)
        self.linear_proj.init_std = proj_std

    def forward(  # type: ignore[override]
        self,
        hidden_states: torch.Tensor,
        rotary: Any = None,
        attention_mask: Any = None,
        *,
        kv_cache: Optional[KVCache] = None,
    ) -> torch.Tensor:
        b, s, _ = hidden_states.shape
        # -1 heads: under tensor parallel the projections are column-sharded and hold only local heads.
        q = self.linear_q(hidden_states).view(b, s, -1, self.head_dim)
        k = self.linear_k(hidden_states).view(b, s, -1, self.head_dim)
        v = self.linear_v(hidden_states).view(b, s, -1, self.v_head_dim)
        if self.value_scale is not None:
            v = v * self.value_scale
        if rotary is not None:
            cos, sin = rotary
            sin_signed = signed_sin(sin)
            q = apply_rotary(q, cos, sin, sin_signed=sin_signed)
            k = apply_rotary(k, cos, sin, sin_signed=sin_signed)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_number, k, v, window=self.window)
        out = self.attend(q, k, v, attention_mask)
        return self.linear_proj(out.transpose(1, 2).reshape(b, s, -1))


class MiMoBlock(TransformerBlock):
    """The decoder: GPT layers, each built from its own arguments, with ``MiMoAttention``."""

    def __init__(self, args: TransformerArgs, layer_args: list[TransformerArgs], v_head_dim: int,
                 value_scale: Optional[float], layer_numbers: Optional[list[int]], post_process: bool) -> None:
        super().__init__(args, layer_numbers=[], post_process=post_process)
        numbers = range(args.num_layers) if layer_numbers is None else layer_numbers
        layers = {}
        for i in numbers:
            layer = TransformerLayer(layer_args[i], i)
            layer.self_attention = MiMoAttention(layer_args[i], i, v_head_dim, value_scale)
            layers[str(i)] = layer
        self.layers = nn.ModuleDict(layers)
        if self.recompute_granularity == "selective":
            for layer in self.layers.values():
                layer.self_attention.recompute_core_attention = True


class MiMoV2FlashModel(DecoderLanguageModel):
    """MiMo-V2-Flash's decoder-only model: ``DecoderLanguageModel``'s embedding, rotary tables, output layer and
    forward contract around a ``MiMoBlock``."""

    def __init__(self, config: Any, pre_process: bool = True, post_process: bool = True,
                 vp_stage: Optional[int] = None, layer_numbers: Optional[list[int]] = None) -> None:
        args = resolve_model_args(config)
        check_mimo_provider(config, args)
        super().__init__(config, args, pre_process, post_process, vp_stage)
        self.position_embedding_type = args.position_embedding_type
        self.linear_cross_entropy = linear_cross_entropy
        scale = config.attention_value_scale
        self.decoder = MiMoBlock(args, mimo_layer_args(config, args), int(config.v_head_dim or args.kv_channels),
                                 None if scale is None else float(scale), layer_numbers, post_process)
        self.output_layer = self.build_output_layer()


def build_mimo_model(provider: Any, pre_process: bool = True, post_process: bool = True,
                     vp_stage: Optional[int] = None, *, materialize: bool = True,
                     layer_numbers: Optional[list[int]] = None) -> MiMoV2FlashModel:
    """A ``MiMoV2FlashModel`` on the meta device, materialized and initialized unless ``materialize`` is False."""
    with torch.device("meta"):
        model = MiMoV2FlashModel(provider, pre_process, post_process, vp_stage, layer_numbers=layer_numbers)
    return materialize_model(model, provider) if materialize else model
