"""Gemma 4's text model (HF ``Gemma4ForCausalLM``) on longspan's GPT blocks.

What differs from the GPT layer (``longspan.models.transformer``), all chosen by ``Gemma4ModelProvider``:

- full-attention layers have their own head width and KV groups (``global_kv_channels``,
  ``num_global_query_groups``) and proportional partial RoPE (``global_rotary_percent``, base
  ``rotary_base[1]``); sliding-window layers use ``kv_channels`` / ``num_query_groups`` and plain RoPE
  (``rotary_base[0]``);
- the softmax scale is 1 (queries and keys are RMS-normed per head); values go through an RMSNorm without a
  weight; with ``attention_k_eq_v`` full-attention layers have no ``linear_v``: the values are ``linear_k``'s
  output before the key norm and RoPE;
- the last ``num_kv_shared_layers`` layers have no ``linear_k`` / ``linear_v`` / ``k_layernorm``: they attend
  with the keys and values of the last earlier layer of their kind (after its cache update, so in generation
  they hold no cache of their own), and with ``use_double_wide_mlp`` their MLP is twice as wide;
- per-layer inputs (``per_layer_embed_dim``): the embedding computes one slice per layer from the token
  (``per_layer_word_embeddings``) and the embedded sequence (``per_layer_projection`` +
  ``per_layer_projection_norm``); after its MLP each layer adds
  ``post_per_layer_input_norm(per_layer_projection(act(per_layer_input_gate(x)) * slice))``;
- every layer's output is multiplied by its ``layer_scalar`` (a persistent buffer, HF's);
- under pipeline parallel (``StageCarry``) a stage hands the next one, beside the hidden states, every layer's
  per-layer inputs and the keys and values KV-shared layers reuse, so a cut may fall anywhere;
- with experts (``num_moe_experts``) every layer's ``mlp`` is ``longspan.families.gemma4.moe.Gemma4MoE``: the
  dense MLP and the routed experts side by side, each with its own norms.

Module names stay the GPT model's (``decoder.layers.{i}.self_attention.linear_q`` ...), so the tensor parallel
plans and the weight tables apply unchanged.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from longspan.core.errors import ConfigError, NotSupportedError
from longspan.families.gemma4.moe import Gemma4MoE, gemma4_moe_problem
from longspan.families.gemma4.stage import StageCarryWidths, stage_carry_problem
from longspan.models.args import TransformerArgs
from longspan.models.gpt import DecoderLanguageModel, LanguageModelEmbedding, resolve_model_args
from longspan.models.loss import linear_cross_entropy
from longspan.models.moe import MoELayer
from longspan.models.init import materialize_model
from longspan.models.rope import RotaryEmbedding, apply_rotary, default_inv_freq
from longspan.models.transformer import (
    KVCache,
    LocalGlobalRotary,
    RMSNorm,
    SelfAttention,
    TransformerBlock,
    TransformerLayer,
    layer_masks,
)

class SharedKV:
    """One forward's keys and values by layer kind, written by the producing layers and read by the KV-shared
    ones. A plain object, not a dict: wrappers that rebuild a module's containers of tensor arguments (FSDP2's
    input casting) would hand each layer a copy, and the writes would not reach the later layers."""

    def __init__(self) -> None:
        self._kv: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def __getitem__(self, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        return self._kv[kind]

    def __setitem__(self, kind: str, kv: tuple[torch.Tensor, torch.Tensor]) -> None:
        self._kv[kind] = kv

    def __contains__(self, kind: str) -> bool:
        return kind in self._kv


class StageCarry:
    """The tensor a pipeline stage hands the next one, ``[b, s, StageCarryWidths.total]``: the hidden states, the
    per-layer inputs of every layer and the keys and values the KV-shared layers reuse (``StageCarryWidths``
    gives the order). A stage after the first unpacks it, a stage before the last packs what it has then:
    gradients flow back through it to the stage that made each part."""

    def __init__(self, provider: Any) -> None:
        self.widths = StageCarryWidths.of(provider)
        self.per_layer_dim = int(provider.per_layer_embed_dim or 0)

    def _kv_spec(self) -> list[tuple[str, int, int]]:
        return [(kind, groups, dim) for kind, (groups, dim) in
                (("sliding", self.widths.sliding_kv), ("full", self.widths.full_kv)) if groups]

    def unpack(self, packed: torch.Tensor, shared: SharedKV) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(hidden states, per-layer inputs ``[b, s, layers, dim]`` or None); the keys and values into
        ``shared``."""
        w = self.widths
        hidden, rest = packed[..., :w.hidden], packed[..., w.hidden:]
        per_layer = None
        if w.per_layer:
            per_layer = rest[..., :w.per_layer].unflatten(-1, (-1, self.per_layer_dim))
            rest = rest[..., w.per_layer:]
        for kind, groups, dim in self._kv_spec():
            k, v, rest = rest.split([groups * dim, groups * dim, rest.shape[-1] - 2 * groups * dim], dim=-1)
            shared[kind] = tuple(t.unflatten(-1, (groups, dim)).transpose(1, 2) for t in (k, v))
        return hidden, per_layer

    def image_tokens(self, packed: torch.Tensor) -> Optional[torch.Tensor]:
        """Which tokens are image tokens (bool ``[b, s]``), when the carry holds that slot (else None)."""
        return packed[..., -1] > 0.5 if self.widths.image else None

    def pack(self, hidden: torch.Tensor, per_layer: Optional[torch.Tensor], shared: SharedKV,
             image_tokens: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The inverse of ``unpack`` and ``image_tokens`` (zeros for keys and values no stage has made yet)."""
        parts = [hidden]
        if self.widths.per_layer:
            parts.append(per_layer.flatten(-2))
        for kind, groups, dim in self._kv_spec():
            if kind in shared:
                parts.extend(t.transpose(1, 2).flatten(-2) for t in shared[kind])
            else:
                parts.append(hidden.new_zeros(*hidden.shape[:-1], 2 * groups * dim))
        if self.widths.image:
            if image_tokens is None:
                raise ValueError("this pipeline stage hands on the image tokens: pass image_tokens")
            parts.append(image_tokens.unsqueeze(-1))
        return torch.cat([p.to(hidden.dtype) for p in parts], dim=-1)


@dataclass
class Gemma4Layout:
    """Per layer: its kind, the layer whose keys/values it reuses (None: its own), whether later layers reuse
    its keys/values, and its typed arguments."""

    kinds: list[str]
    """'sliding' or 'full' per global layer index."""
    kv_source: list[Optional[int]]
    stores_kv: list[bool]
    layer_args: list[TransformerArgs]


def gemma4_layout(provider: Any, args: TransformerArgs) -> Gemma4Layout:
    """Check the Gemma 4 fields of ``provider`` and lay out its layers (one-line errors naming the field)."""
    n = args.num_layers
    shared = int(provider.num_kv_shared_layers or 0)
    if not 0 <= shared < n:
        raise ConfigError(f"model.num_kv_shared_layers={provider.num_kv_shared_layers} with num_layers={n}: "
                          f"at most {n - 1} layers can reuse earlier layers' keys and values")
    windows = args.layer_windows or [None] * n
    kinds = ["full" if w is None else "sliding" for w in windows]
    first_shared = n - shared
    source: list[Optional[int]] = [None] * n
    for i in range(first_shared, n):
        earlier = [j for j in range(first_shared) if kinds[j] == kinds[i]]
        if not earlier:
            raise ConfigError(f"model.num_kv_shared_layers={shared}: layer {i} ({kinds[i]} attention) has no earlier "
                              "layer of its kind to take keys and values from")
        source[i] = earlier[-1]
    stores = [i in source for i in range(n)]
    global_kv = provider.global_kv_channels or args.kv_channels
    global_groups = provider.num_global_query_groups or args.num_query_groups
    layer_args = []
    for i in range(n):
        changes: dict[str, Any] = {}
        if kinds[i] == "full":
            changes.update(kv_channels=int(global_kv), num_query_groups=int(global_groups))
        if source[i] is not None and provider.use_double_wide_mlp:
            changes["ffn_hidden_size"] = 2 * args.ffn_hidden_size
        layer_args.append(dataclasses.replace(args, **changes) if changes else args)
    return Gemma4Layout(kinds, source, stores, layer_args)


def check_gemma4_provider(provider: Any, args: TransformerArgs) -> None:
    """What longspan's Gemma 4 cannot build: one line naming the field."""
    tp = int(provider.tensor_model_parallel_size or 1)
    groups = provider.num_global_query_groups or args.num_query_groups
    if groups % tp or args.num_attention_heads % tp:
        raise ConfigError(f"model.num_global_query_groups={groups} with tensor_model_parallel_size={tp}: tensor "
                          "parallel splits whole KV groups of the full-attention layers; use a tp that divides it")
    if args.rotary_base_local is None or args.global_rope_linear_factor != 1.0:
        raise NotSupportedError("model.rotary_base must be [sliding-window base, full-attention base] for Gemma 4 "
                                "(and rope_scaling_factor 1.0)")
    if not 0.0 < float(provider.global_rotary_percent) <= 1.0:
        raise ConfigError(f"model.global_rotary_percent={provider.global_rotary_percent}: expected 0 < p <= 1")
    problem = gemma4_moe_problem(provider)
    if problem is not None:
        raise NotSupportedError(problem)
    for name in ("fp32_residual_connection", "apply_residual_connection_post_layernorm", "multi_latent_attention",
                 "attention_output_gate", "mtp_num_layers", "attn_logit_softcapping"):
        if getattr(provider, name, None):
            raise NotSupportedError(f"model.{name}={getattr(provider, name)!r} is not supported yet for Gemma 4")
    if args.rotary_interleaved or args.gated_delta_net is not None:
        raise NotSupportedError("model.rotary_interleaved / experimental_attention_variant are not supported for "
                                "Gemma 4")

def stage_carry(provider: Any, pre_process: bool, post_process: bool) -> Optional[StageCarry]:
    """The carry of a pipeline stage (not both first and last) of a model with KV sharing, per-layer inputs or
    image tokens attending both ways, else None; a one-line NotSupportedError where the layout cannot exchange
    them (``stage_carry_problem``)."""
    if (pre_process and post_process) or not provider.stages_exchange_more_than_hidden():
        return None
    problem = stage_carry_problem(provider)
    if problem is not None:
        raise NotSupportedError(problem)
    return StageCarry(provider)


class ProportionalRotaryEmbedding(RotaryEmbedding):
    """HF's proportional RoPE over a whole head of ``head_dim`` channels: the first ``int(percent * head_dim / 2)``
    frequencies are ``base^(-2i/head_dim)`` (the full width's), the rest zero, so those channel pairs
    (``i`` and ``i + head_dim / 2``) do not rotate."""

    def __init__(self, head_dim: int, percent: float, rotary_base: float) -> None:
        super().__init__(head_dim, rotary_base=rotary_base)
        self.rotating = int(percent * head_dim // 2)

    def _static_inv_freq(self, kind: str) -> torch.Tensor:
        inv = default_inv_freq(self.rot_dim, self.rotary_base)
        inv[self.rotating:] = 0.0
        return inv


def value_norm(v: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma 4's scale-free RMSNorm of the values, in float32, cast back."""
    return F.rms_norm(v.float(), (v.shape[-1],), eps=eps).to(v.dtype)


class Gemma4Attention(SelfAttention):
    """``SelfAttention`` with Gemma 4's value norm, keys as values on full-attention layers (``linear_v`` None) and KV sharing
    (``kv_source`` set: no ``linear_k`` / ``linear_v`` / ``k_layernorm``; keys and values from ``shared_kv``)."""

    def __init__(self, config: TransformerArgs, layer_number: int, kind: str, kv_source: Optional[int],
                 stores_kv: bool, k_eq_v: bool) -> None:
        super().__init__(config, layer_number)
        self.kind = kind
        self.kv_source = kv_source
        self.stores_kv = stores_kv
        self.eps = config.layernorm_epsilon
        if (k_eq_v and kind == "full") or kv_source is not None:
            self.linear_v = None
        if kv_source is not None:
            self.linear_k = None
            self.k_layernorm = None

    def forward(  # type: ignore[override]
        self,
        hidden_states: torch.Tensor,
        rotary: Any = None,
        attention_mask: Any = None,
        *,
        kv_cache: Optional[KVCache] = None,
        shared_kv: Optional[SharedKV] = None,
    ) -> torch.Tensor:
        b, s, _ = hidden_states.shape
        cos, sin = rotary
        q = self.q_layernorm(self.linear_q(hidden_states).view(b, s, -1, self.head_dim))
        q = apply_rotary(q, cos, sin).transpose(1, 2)
        if self.kv_source is not None:
            k, v = shared_kv[self.kind]
        else:
            raw = self.linear_k(hidden_states).view(b, s, -1, self.head_dim)
            v = raw if self.linear_v is None else self.linear_v(hidden_states).view(b, s, -1, self.head_dim)
            k = apply_rotary(self.k_layernorm(raw), cos, sin).transpose(1, 2)
            v = value_norm(v, self.eps).transpose(1, 2)
            if kv_cache is not None:
                k, v = kv_cache.update(self.layer_number, k, v, window=self.window)
            if self.stores_kv and shared_kv is not None:
                shared_kv[self.kind] = (k, v)
        out = self.attend(q, k, v, attention_mask)
        return self.linear_proj(out.transpose(1, 2).reshape(b, s, -1))


class Gemma4Layer(TransformerLayer):
    """A Gemma 4 decoder layer: the GPT layer's norms before and after attention and the MLP, then the
    per-layer input (when the model has them), then ``* layer_scalar``."""

    def __init__(self, config: TransformerArgs, layer_number: int, layout: Gemma4Layout, provider: Any) -> None:
        super().__init__(config, layer_number)
        kind = layout.kinds[layer_number]
        self.kind = kind
        self.self_attention = Gemma4Attention(config, layer_number, kind, layout.kv_source[layer_number],
                                              layout.stores_kv[layer_number], bool(provider.attention_k_eq_v))
        dim = int(provider.per_layer_embed_dim or 0)
        self.per_layer_input_gate: Optional[nn.Linear] = None
        if dim:
            dtype, std = config.params_dtype, config.init_method_std
            self.per_layer_input_gate = nn.Linear(config.hidden_size, dim, bias=False, dtype=dtype)
            self.per_layer_input_gate.init_std = std
            self.per_layer_projection = nn.Linear(dim, config.hidden_size, bias=False, dtype=dtype)
            self.per_layer_projection.init_std = std
            self.post_per_layer_input_norm = RMSNorm(config.hidden_size, config.layernorm_epsilon, dtype)
        self.activation_func: Callable[[torch.Tensor], torch.Tensor] = config.activation_func
        if isinstance(self.mlp, MoELayer):  # the MoE block beside the dense MLP; it norms its own inputs
            self.mlp = Gemma4MoE(config, layer_number)
            self.pre_mlp_layernorm = None
        self.register_buffer("layer_scalar", torch.ones(1, dtype=config.params_dtype))

    def _apply(self, fn: Callable[..., Any], recurse: bool = True) -> "Gemma4Layer":
        was_meta = self.layer_scalar.is_meta
        super()._apply(fn, recurse)
        if was_meta and not self.layer_scalar.is_meta:  # to_empty() of a meta-built model: HF's init, one
            self.layer_scalar.fill_(1.0)
        return self

    def forward(  # type: ignore[override]
        self,
        hidden_states: torch.Tensor,
        rotary: Any = None,
        attention_mask: Any = None,
        *,
        kv_cache: Optional[KVCache] = None,
        shared_kv: Optional[SharedKV] = None,
        per_layer_input: Optional[torch.Tensor] = None,
        cu_seqlens: Any = None,
    ) -> torch.Tensor:
        if isinstance(rotary, LocalGlobalRotary):
            rotary = rotary.local_tables if self.kind == "sliding" else rotary.global_tables
        normed = self.input_layernorm(hidden_states)
        attn = self.self_attention(normed, rotary, attention_mask, kv_cache=kv_cache, shared_kv=shared_kv)
        hidden_states = hidden_states + self.self_attn_dropout(self.post_self_attn_layernorm(attn))
        norm = self.pre_mlp_layernorm
        mlp = self.mlp(hidden_states if norm is None else norm(hidden_states))
        hidden_states = hidden_states + self.mlp_dropout(self.post_mlp_layernorm(mlp))
        if self.per_layer_input_gate is not None:
            gated = self.activation_func(self.per_layer_input_gate(hidden_states)) * per_layer_input
            hidden_states = hidden_states + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return hidden_states * self.layer_scalar


class Gemma4Block(TransformerBlock):
    """The decoder: Gemma 4 layers, one ``shared_kv`` store per forward (the producing layers write their keys
    and values, the KV-shared layers read them) and each layer's slice of the per-layer inputs."""

    def __init__(self, config: TransformerArgs, layout: Gemma4Layout, provider: Any,
                 layer_numbers: Optional[list[int]], post_process: bool) -> None:
        super().__init__(config, layer_numbers=[], post_process=post_process)
        numbers = range(config.num_layers) if layer_numbers is None else layer_numbers
        self.layers = nn.ModuleDict({str(i): Gemma4Layer(layout.layer_args[i], i, layout, provider)
                                     for i in numbers})
        if self.recompute_granularity == "selective":
            for layer in self.layers.values():
                layer.self_attention.recompute_core_attention = True
        # set by the model for the length of a forward: the per-layer inputs, and the keys and values store
        # (filled from the previous pipeline stage's carry; read for the next stage's)
        self.per_layer_inputs: Optional[torch.Tensor] = None
        self.stage_kv: Optional[SharedKV] = None

    def forward(  # type: ignore[override]
        self,
        hidden_states: torch.Tensor,
        rotary: Any = None,
        attention_mask: Any = None,
        *,
        kv_cache: Optional[KVCache] = None,
        cu_seqlens: Any = None,
    ) -> torch.Tensor:
        layers = list(self.layers.values())
        masks = layer_masks(layers, attention_mask)
        shared = self.stage_kv if self.stage_kv is not None else SharedKV()
        full = self.recompute_granularity == "full" and torch.is_grad_enabled() and kv_cache is None
        every = self.recompute_num_layers or 1
        for index, (layer, mask) in enumerate(zip(layers, masks)):
            extra = None
            if self.per_layer_inputs is not None:
                extra = self.per_layer_inputs[:, :, layer.layer_number]
            kwargs = dict(kv_cache=kv_cache, shared_kv=shared, per_layer_input=extra)
            if full and (self.recompute_method == "uniform" or index < every or self.recompute_all_layers):
                hidden_states = checkpoint(layer, hidden_states, rotary, mask, use_reentrant=False, **kwargs)
            else:
                hidden_states = layer(hidden_states, rotary, mask, **kwargs)
        if self.final_layernorm is not None:
            hidden_states = self.final_layernorm(hidden_states)
        return hidden_states


class Gemma4Embedding(LanguageModelEmbedding):
    """The scaled word embeddings and, with per-layer inputs, what makes them: ``per_layer_word_embeddings``
    ``[per_layer_vocab, layers * dim]`` (scaled by sqrt(dim)), ``per_layer_projection`` ``[layers * dim, hidden]``
    and ``per_layer_projection_norm`` (over ``dim``)."""

    def __init__(self, args: TransformerArgs, provider: Any) -> None:
        super().__init__(args)
        self.per_layer_dim = int(provider.per_layer_embed_dim or 0)
        if self.per_layer_dim:
            width = args.num_layers * self.per_layer_dim
            vocab = int(provider.per_layer_embed_vocab_size or provider.vocab_size)
            dtype = args.params_dtype
            self.per_layer_word_embeddings = nn.Embedding(vocab, width, dtype=dtype)
            self.per_layer_word_embeddings.init_std = args.embedding_init_method_std
            self.per_layer_projection = nn.Linear(args.hidden_size, width, bias=False, dtype=dtype)
            self.per_layer_projection.init_std = args.init_method_std
            self.per_layer_projection_norm = RMSNorm(self.per_layer_dim, args.layernorm_epsilon, dtype)

    def per_layer_inputs(self, input_ids: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        """``[b, s, layers, dim]``: HF's ``(norm(proj(e) / sqrt(hidden)) + table(ids) * sqrt(dim)) / sqrt(2)``,
        each scale a float32 number rounded to the tensors' dtype."""
        b, s = input_ids.shape
        dim, hidden = self.per_layer_dim, embeddings.shape[-1]
        dtype = embeddings.dtype
        projected = self.per_layer_projection(embeddings) * _scalar(hidden**-0.5, dtype, embeddings.device)
        projected = self.per_layer_projection_norm(projected.view(b, s, -1, dim))
        tokens = self.per_layer_word_embeddings(input_ids) * _scalar(dim**0.5, dtype, embeddings.device)
        return (projected + tokens.view(b, s, -1, dim)) * 2.0**-0.5


def _scalar(value: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32, device=device).to(dtype)


class Gemma4Model(DecoderLanguageModel):
    """Gemma 4's decoder-only model: ``DecoderLanguageModel``'s embedding (``Gemma4Embedding``), output layer,
    soft-capped logits and forward contract around a ``Gemma4Block``; full-attention layers rotate with
    ``ProportionalRotaryEmbedding`` (``rotary_pos_emb``), sliding-window ones with ``local_rotary_pos_emb``."""

    def __init__(self, config: Any, pre_process: bool = True, post_process: bool = True,
                 vp_stage: Optional[int] = None, layer_numbers: Optional[list[int]] = None) -> None:
        args = resolve_model_args(config)
        check_gemma4_provider(config, args)
        carry = stage_carry(config, pre_process, post_process)
        layout = gemma4_layout(config, args)
        super().__init__(config, args, pre_process, post_process, vp_stage)
        self.layout = layout
        self.stage_carry = carry
        self.position_embedding_type = args.position_embedding_type
        self.linear_cross_entropy = linear_cross_entropy
        if pre_process:
            self.embedding = Gemma4Embedding(args, config)
        global_kv = int(config.global_kv_channels or args.kv_channels)
        self.rotary_pos_emb = ProportionalRotaryEmbedding(global_kv, float(config.global_rotary_percent),
                                                          args.rotary_base)
        self.local_rotary_pos_emb = RotaryEmbedding(args.kv_channels, rotary_base=args.rotary_base_local)
        self.decoder = Gemma4Block(args, layout, config, layer_numbers, post_process)
        self.output_layer = self.build_output_layer()

    def forward(self, input_ids: Optional[torch.Tensor] = None, position_ids: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None, labels: Optional[torch.Tensor] = None,
                **kwargs: Any) -> torch.Tensor:
        """``DecoderLanguageModel.forward``; with per-layer inputs the first stage embeds the tokens itself and
        hands the decoder each layer's slice. Given ``decoder_input`` (a vision-language model's embeddings with
        its images put in), the slices' token part comes from ``input_ids`` and their projection from
        ``decoder_input``, as transformers' ``Gemma4Model`` does. A pipeline stage with a ``stage_carry`` takes
        (after the first) and returns (before the last) the packed tensor ``StageCarry`` describes instead of the
        hidden states. ``image_tokens`` (bool ``[b, s]``, the first stage's; later stages read it from the carry)
        travels in the carry for the image blocks' mask of the next stages."""
        image_tokens = kwargs.pop("image_tokens", None)
        embedding = self.embedding if self.pre_process else None
        carry = self.stage_carry
        if carry is None and (embedding is None or not embedding.per_layer_dim):
            return super().forward(input_ids, position_ids, attention_mask, labels, **kwargs)
        shared = SharedKV()
        if embedding is not None:
            embedded = kwargs.get("decoder_input")
            if embedded is None:
                embedded = kwargs["decoder_input"] = embedding(input_ids, position_ids)
            per_layer = None
            if embedding.per_layer_dim:
                per_layer = embedding.per_layer_inputs(input_ids, embedded)
        else:
            packed = kwargs.pop("hidden_states", None)
            packed = input_ids if packed is None else packed
            hidden, per_layer = carry.unpack(packed, shared)
            image_tokens = carry.image_tokens(packed)
            input_ids, kwargs["hidden_states"] = None, hidden
        self.decoder.per_layer_inputs, self.decoder.stage_kv = per_layer, shared
        try:
            output = super().forward(input_ids, position_ids, attention_mask, labels, **kwargs)
        finally:
            self.decoder.per_layer_inputs = self.decoder.stage_kv = None
        return output if self.post_process else carry.pack(output, per_layer, shared, image_tokens)


def build_gemma4_model(provider: Any, pre_process: bool = True, post_process: bool = True,
                       vp_stage: Optional[int] = None, *, materialize: bool = True,
                       layer_numbers: Optional[list[int]] = None) -> Gemma4Model:
    """A ``Gemma4Model`` on the meta device, materialized and initialized unless ``materialize`` is False."""
    with torch.device("meta"):
        model = Gemma4Model(provider, pre_process, post_process, vp_stage, layer_numbers=layer_numbers)
    return materialize_model(model, provider) if materialize else model
