"""The T5 encoder-decoder model, built from a ``T5ModelProvider``.

Plain PyTorch, Megatron Core's T5 names, parallelism applied from outside (``longspan.parallel``)::

    embedding.word_embeddings                      nn.Embedding [padded_vocab, hidden] (encoder and decoder)
    embedding.position_embeddings                  nn.Embedding [max_position_embeddings, hidden] (learned_absolute)
    encoder_relative_pos_emb.relative_attention_bias  nn.Embedding [buckets, heads] (relative; bidirectional)
    decoder_relative_pos_emb.relative_attention_bias  nn.Embedding [buckets, heads] (relative; causal buckets)
    encoder.layers.{i}.input_layernorm / self_attention.linear_q|k|v|proj / pre_mlp_layernorm / mlp.*
    encoder.final_layernorm
    decoder.layers.{i}.input_layernorm / self_attention.* / pre_cross_attn_layernorm
    decoder.layers.{i}.cross_attention.linear_q|k|v|proj   (q from the decoder, k/v from the encoder output)
    decoder.layers.{i}.pre_mlp_layernorm / mlp.linear_fc1 (up), linear_fc1_gate (gated), linear_fc2
    decoder.final_layernorm
    output_layer                                   nn.Linear [padded_vocab, hidden] (absent when tied)

Attention takes an additive float bias ``[b or 1, heads, q, k]`` (relative position bias plus large negative
values where masked), computed once per forward and shared by every layer, as T5 does. Masks follow Megatron:
bool, True = masked. With relative positions, ``softmax_scale=1.0`` gives T5's unscaled attention.

Sliding windows (``window_size=[left, right]``, ``window_attn_skip_freq``) follow Megatron's T5, whose every
attention (Transformer Engine's or the local DotProductAttention) takes the config's window on the layers
``is_layer_window_attention`` picks, each stack numbering its own layers from 1 (``stack_window_flags``):

- encoder self-attention (bidirectional): query i sees keys i - left ... i + right;
- decoder self-attention (causal): keys i - left ... i (Transformer Engine sets right to 0 under a causal mask);
- cross-attention: the same two-sided band, aligned bottom-right as Transformer Engine and the local softmax
  align it: decoder query i sees encoder keys around i + s_enc - s_dec (s_enc - s_dec + i - left ...
  s_enc - s_dec + i + right), on the whole (padded) lengths.

-1 leaves that side unbounded. The band is merged with the caller's masks before they become a bias (a key is
seen only if both allow it), so a windowed layer uses its own bias (``LayerBiases``), built once per forward.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from longspan.models.args import T5Args
from longspan.models.init import materialize_model
from longspan.models.rope import RotaryEmbedding, apply_rotary
from longspan.models.transformer import MLP, _linear, build_norm, norm_residual

# TransformerConfig / T5ModelProvider fields this model implements only at these values (the GPT model's
# extras, not built into T5 yet). Pure kernel choices are accepted.
def relative_position_bucket(
    relative_position: torch.Tensor, bidirectional: bool, num_buckets: int, max_distance: int
) -> torch.Tensor:
    """T5's bucket of each ``key - query`` offset: exact buckets for small distances, log-spaced up to
    ``max_distance``; bidirectional buckets give half of them to keys after the query."""
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets += (relative_position > 0).long() * num_buckets
        distance = relative_position.abs()
    else:
        distance = (-relative_position).clamp(min=0)  # a causal decoder only looks back
    max_exact = num_buckets // 2
    is_small = distance < max_exact
    log_ratio = torch.log(distance.float() / max_exact) / math.log(max_distance / max_exact)
    large = max_exact + (log_ratio * (num_buckets - max_exact)).long()
    large = large.clamp(max=num_buckets - 1)
    return buckets + torch.where(is_small, distance, large)


class RelativePositionBias(nn.Module):
    """A learned scalar per (bucket, head), looked up as an additive attention bias ``[1, heads, q, k]``."""

    def __init__(self, args: T5Args, bidirectional: bool) -> None:
        super().__init__()
        self.bidirectional = bidirectional
        self.num_buckets = args.relative_attention_num_buckets
        self.max_distance = args.relative_attention_max_distance
        self.relative_attention_bias = nn.Embedding(self.num_buckets, args.num_attention_heads, dtype=args.params_dtype)
        self.relative_attention_bias.init_std = args.init_method_std

    def forward(self, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
        """The bias of queries at ``query_positions [q]`` over keys at ``key_positions [k]``."""
        relative = key_positions[None, :] - query_positions[:, None]
        buckets = relative_position_bucket(relative, self.bidirectional, self.num_buckets, self.max_distance)
        # [q, k, heads]; under tensor parallel the table is split by heads and this holds the local heads.
        return self.relative_attention_bias(buckets).permute(2, 0, 1).unsqueeze(0)


class Attention(nn.Module):
    """Multi-head attention with an additive bias; self-attention, or cross-attention over ``key_value_states``."""

    def __init__(self, args: T5Args) -> None:
        super().__init__()
        heads, hidden, dtype = args.num_attention_heads, args.hidden_size, args.params_dtype
        self.head_dim = args.kv_channels
        qkv_bias = args.add_bias_linear or args.add_qkv_bias
        std = args.init_method_std
        out_std = std / math.sqrt(2.0 * args.num_layers)
        self.linear_q = _linear(hidden, heads * self.head_dim, qkv_bias, std, dtype)
        self.linear_k = _linear(hidden, heads * self.head_dim, qkv_bias, std, dtype)
        self.linear_v = _linear(hidden, heads * self.head_dim, qkv_bias, std, dtype)
        self.linear_proj = _linear(heads * self.head_dim, hidden, args.add_bias_linear, out_std, dtype)
        # qk_layernorm: a norm over each head's channels of the queries and keys (Megatron's per-head QK norm)
        self.q_layernorm = build_norm(args, self.head_dim) if args.qk_layernorm else None
        self.k_layernorm = build_norm(args, self.head_dim) if args.qk_layernorm else None
        self.rotary_interleaved = args.rotary_interleaved
        self.attention_dropout = args.attention_dropout
        self.softmax_scale = args.softmax_scale
        # recompute_granularity='selective': the attention core is recomputed in the backward pass.
        self.recompute_core_attention = False
        # The attention core ``(q, k, v, bias, dropout_p, scale)``; context parallel swaps in one that gathers
        # the keys and values of the whole sequence (longspan.parallel.t5).
        self.core_attention: Callable[..., torch.Tensor] = (
            biased_attention if args.attention_softmax_in_fp32 else low_precision_biased_attention
        )

    def forward(
        self, hidden_states: torch.Tensor, bias: torch.Tensor, key_value_states: torch.Tensor | None = None,
        *, rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``rotary``: ``(cos, sin)`` of the tokens' positions (self-attention with rotary positions)."""
        b, s, _ = hidden_states.shape
        source = hidden_states if key_value_states is None else key_value_states
        # -1 heads: under tensor parallel the projections are column-sharded and hold only local heads.
        q = self.linear_q(hidden_states).view(b, s, -1, self.head_dim)
        k = self.linear_k(source).view(b, source.shape[1], -1, self.head_dim)
        if self.q_layernorm is not None:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        if rotary is not None:
            cos, sin = rotary
            q = apply_rotary(q, cos, sin, interleaved=self.rotary_interleaved)
            k = apply_rotary(k, cos, sin, interleaved=self.rotary_interleaved)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.linear_v(source).view(b, source.shape[1], -1, self.head_dim).transpose(1, 2)
        dropout_p = self.attention_dropout if self.training else 0.0
        if self.recompute_core_attention and torch.is_grad_enabled():
            out = checkpoint(self.core_attention, q, k, v, bias, dropout_p, self.softmax_scale, use_reentrant=False)
        else:
            out = self.core_attention(q, k, v, bias, dropout_p, self.softmax_scale)
        return self.linear_proj(out.transpose(1, 2).reshape(b, s, -1))


def biased_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, dropout_p: float,
                     scale: float | None) -> torch.Tensor:
    """SDPA of ``q [b, heads, q, d]`` over ``k``/``v`` ``[b, heads, k, d]`` with the additive ``bias``."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype), dropout_p=dropout_p, scale=scale)


def low_precision_biased_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
                                   dropout_p: float, scale: float | None) -> torch.Tensor:
    """``biased_attention`` with the scores and probabilities kept in the inputs' dtype
    (``attention_softmax_in_fp32=False``: Megatron's unfused softmax without the fp32 upcast); float32 inputs
    take ``biased_attention`` (the same maths)."""
    if q.dtype == torch.float32:
        return biased_attention(q, k, v, bias, dropout_p, scale)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale + bias.to(q.dtype)
    probs = torch.softmax(scores, dim=-1)  # stays in the inputs' dtype
    probs = F.dropout(probs, p=dropout_p) if dropout_p > 0 else probs
    return torch.matmul(probs, v)


class T5Layer(nn.Module):
    """Pre-norm layer: self-attention, (decoder only) cross-attention, MLP; each a dropped-out residual add.
    ``windowed``: its attentions take the sliding window's bias (``LayerBiases.windowed``)."""

    def __init__(self, args: T5Args, is_decoder: bool, windowed: bool = False) -> None:
        super().__init__()
        self.windowed = windowed
        # apply_residual_connection_post_layernorm: each residual branch starts from the norm's output
        self.residual_after_norm = args.apply_residual_connection_post_layernorm
        self.input_layernorm = build_norm(args, args.hidden_size)
        self.self_attention = Attention(args)
        self.self_attn_dropout = nn.Dropout(args.hidden_dropout)
        if is_decoder:
            self.pre_cross_attn_layernorm = build_norm(args, args.hidden_size)
            self.cross_attention = Attention(args)
            self.cross_attn_dropout = nn.Dropout(args.hidden_dropout)
        else:
            self.cross_attention = None
        self.pre_mlp_layernorm = build_norm(args, args.hidden_size)
        self.mlp = MLP(args)
        self.mlp_dropout = nn.Dropout(args.hidden_dropout)
        self.fp32_residual, self.params_dtype = args.fp32_residual_connection, args.params_dtype

    def _norm(self, norm: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the norm's output for the sub-layer, the residual its branch adds to): with
        ``fp32_residual_connection`` the residual in float32 and the output in the parameters' dtype."""
        if not self.fp32_residual:
            normed = norm(x)
            return normed, normed if self.residual_after_norm else x
        normed = norm_residual(norm, x, self.params_dtype)
        return normed, (normed.float() if self.residual_after_norm else x)

    def forward(
        self,
        hidden_states: torch.Tensor,
        self_bias: torch.Tensor | LayerBiases,
        encoder_output: torch.Tensor | None = None,
        cross_bias: torch.Tensor | LayerBiases | None = None,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        self_bias, cross_bias = layer_bias(self_bias, self.windowed), layer_bias(cross_bias, self.windowed)
        normed, residual = self._norm(self.input_layernorm, hidden_states)
        # rotary positions rotate self-attention only (Megatron's T5: cross-attention keys are another sequence)
        hidden_states = residual + self.self_attn_dropout(self.self_attention(normed, self_bias, rotary=rotary))
        if self.cross_attention is not None:
            normed, residual = self._norm(self.pre_cross_attn_layernorm, hidden_states)
            hidden_states = residual + self.cross_attn_dropout(self.cross_attention(normed, cross_bias, encoder_output))
        normed, residual = self._norm(self.pre_mlp_layernorm, hidden_states)
        return residual + self.mlp_dropout(self.mlp(normed))


class T5Stack(nn.Module):
    """The encoder or the decoder: ``layers`` (a ``ModuleDict`` keyed by layer index) and ``final_layernorm``.
    A pipeline stage holds some of the layers (``layer_numbers``) and the norm only with the stack's last layer.

    Activation recompute (Megatron's semantics, per stack): ``'full'`` + ``'uniform'`` checkpoints consecutive
    chunks of ``recompute_num_layers`` layers, ``'full'`` + ``'block'`` each of the first
    ``recompute_num_layers`` layers, ``'selective'`` only the attention cores (self and cross).
    ``recompute_all_layers`` (set per microbatch by the pipeline schedule, see ``TransformerBlock``) makes
    ``'block'`` checkpoint every layer."""

    def __init__(self, args: T5Args, num_layers: int, is_decoder: bool, layer_numbers: list[int] | None = None,
                 final_norm: bool = True) -> None:
        super().__init__()
        stack_args = args.for_stack(num_layers)  # init std scales with the whole stack's depth
        numbers = range(num_layers) if layer_numbers is None else layer_numbers
        windowed = (args.decoder_layer_windowed if is_decoder else args.encoder_layer_windowed) or [False] * num_layers
        self.layers = nn.ModuleDict({str(i): T5Layer(stack_args, is_decoder, windowed[i]) for i in numbers})
        self.final_layernorm = build_norm(args, args.hidden_size) if final_norm else None
        self.recompute_granularity = args.recompute_granularity
        self.recompute_method = args.recompute_method
        self.recompute_num_layers = args.recompute_num_layers
        self.partial_checkpoint_microbatches = args.partial_checkpoint_microbatches
        self.recompute_all_layers = False
        self.fp32_residual, self.params_dtype = args.fp32_residual_connection, args.params_dtype
        if self.recompute_granularity == "selective":
            for layer in self.layers.values():
                for attention in (layer.self_attention, layer.cross_attention):
                    if attention is not None:
                        attention.recompute_core_attention = True

    def forward(
        self,
        hidden_states: torch.Tensor,
        self_bias: torch.Tensor | LayerBiases,
        encoder_output: torch.Tensor | None = None,
        cross_bias: torch.Tensor | LayerBiases | None = None,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        layers = list(self.layers.values())
        if self.fp32_residual:  # Megatron casts the embeddings' output; the encoder output feeds cross-attention
            hidden_states = hidden_states.float()
            encoder_output = None if encoder_output is None else encoder_output.to(self.params_dtype)
        extra = (self_bias, encoder_output, cross_bias, rotary)
        if self.recompute_granularity == "full" and torch.is_grad_enabled():
            n = self.recompute_num_layers
            if self.recompute_method == "uniform":
                for start in range(0, len(layers), n):
                    hidden_states = checkpoint(_run_layers, layers[start: start + n], hidden_states, *extra,
                                               use_reentrant=False)
            else:  # 'block': the first n layers are recomputed, the rest keep their activations
                for index, layer in enumerate(layers):
                    if index < n or self.recompute_all_layers:
                        hidden_states = checkpoint(layer, hidden_states, *extra, use_reentrant=False)
                    else:
                        hidden_states = layer(hidden_states, *extra)
        else:
            hidden_states = _run_layers(layers, hidden_states, *extra)
        return self.final_norm(hidden_states)

    def final_norm(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The stack's final norm where this stage holds it (in the parameters' dtype with a float32 residual
        stream), else the residual stream itself."""
        if self.final_layernorm is None:
            return hidden_states
        if self.fp32_residual:
            return norm_residual(self.final_layernorm, hidden_states, self.params_dtype)
        return self.final_layernorm(hidden_states)


def _run_layers(layers: list[nn.Module], hidden_states: torch.Tensor, self_bias: torch.Tensor | LayerBiases,
                encoder_output: torch.Tensor | None, cross_bias: torch.Tensor | LayerBiases | None,
                rotary: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    for layer in layers:
        hidden_states = layer(hidden_states, self_bias, encoder_output, cross_bias, rotary)
    return hidden_states


def _as_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    """Megatron's mask (bool, True = masked; or non-zero = masked) as bool ``[b or 1, 1 or heads, q, k]``."""
    if mask is None:
        return None
    if mask.dtype != torch.bool:
        mask = mask != 0
    if mask.dim() == 2:
        return mask[None, None]
    return mask[:, None] if mask.dim() == 3 else mask


def _mask_bias(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A bool mask as an additive bias: the dtype's lowest finite value where masked (finite, so a fully
    masked row stays defined, as in T5; masks are merged before, so two never add up to -inf)."""
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask, torch.finfo(dtype).min)


def _attention_bias(position_bias: torch.Tensor | None, mask: torch.Tensor | None, query_length: int,
                    key_length: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The additive attention bias: ``position_bias`` plus ``mask`` (bool, True = masked) as a bias, or zeros
    ``[1, 1, q, k]`` when there is neither."""
    mask_bias = _mask_bias(mask, dtype)
    if position_bias is None and mask_bias is None:
        return torch.zeros(1, 1, query_length, key_length, dtype=dtype, device=device)
    if position_bias is None or mask_bias is None:
        return position_bias if mask_bias is None else mask_bias
    return position_bias + mask_bias


class LayerBiases(NamedTuple):
    """A stack's attention bias when some of its layers attend within a sliding window: ``full`` for the others,
    ``windowed`` (the window's band merged into the masks) for those."""

    full: torch.Tensor
    windowed: torch.Tensor


def layer_bias(bias: torch.Tensor | LayerBiases | None, windowed: bool) -> torch.Tensor | None:
    """The bias one layer attends with: its half of ``LayerBiases``, else ``bias`` itself."""
    if isinstance(bias, LayerBiases):
        return bias.windowed if windowed else bias.full
    return bias


def window_band(query_positions: torch.Tensor, query_length: int, key_length: int, left: int,
                right: int) -> torch.Tensor:
    """Bool ``[1, 1, q, k]``, True = masked: the query at position p (of ``query_length``) sees key j when
    ``p + offset - left <= j <= p + offset + right``, ``offset = key_length - query_length`` (bottom-right
    aligned, as Megatron's attentions align a window); -1 leaves that side unbounded."""
    keys = torch.arange(key_length, device=query_positions.device)
    distance = keys[None, :] - (query_positions[:, None] + key_length - query_length)
    masked = torch.zeros(distance.shape, dtype=torch.bool, device=distance.device)
    if left >= 0:
        masked |= distance < -left
    if right >= 0:
        masked |= distance > right
    return masked[None, None]


def _stack_bias(layers: nn.ModuleDict, position_bias: torch.Tensor | None, mask: torch.Tensor | None,
                band: torch.Tensor | None, query_length: int, key_length: int, dtype: torch.dtype,
                device: torch.device) -> torch.Tensor | LayerBiases:
    """The bias of a stack's attention: one tensor when all its layers (this stage holds) attend alike, else
    ``LayerBiases``; a windowed layer's merges ``band`` into ``mask``."""
    kinds = {layer.windowed for layer in layers.values()} if band is not None else {False}
    full = _attention_bias(position_bias, mask, query_length, key_length, dtype, device) if False in kinds else None
    if True not in kinds:
        return full
    windowed_mask = band if mask is None else mask | band
    windowed = _attention_bias(position_bias, windowed_mask, query_length, key_length, dtype, device)
    return windowed if full is None else LayerBiases(full, windowed)


class SequenceSlice(NamedTuple):
    """The tokens one call holds of a longer sequence (context parallel): their global ``positions [s]`` and
    the whole sequence's ``length``; keys and values arrive whole (the attention core gathers them)."""

    positions: torch.Tensor
    length: int


def _whole(length: int, device: torch.device) -> SequenceSlice:
    return SequenceSlice(torch.arange(length, device=device), length)


class T5Model(nn.Module):
    """Encoder-decoder transformer (Megatron Core's T5Model in plain PyTorch).

    Pipeline stages (``longspan.parallel.pipeline``) cut the encoder layers followed by the decoder layers
    as one sequence of ``encoder_num_layers + num_layers`` layers (``layer_numbers`` index it). The first stage
    (``pre_process``) embeds the encoder and the decoder tokens; stages exchange one tensor, the encoder's and
    the decoder's hidden states concatenated along the sequence ``[b, s_enc + s_dec, hidden]``: a stage runs
    its encoder layers on the first part (and the encoder's final norm with its last layer) and its decoder
    layers on the second, cross-attending to the first, which every decoder stage therefore holds. The last
    stage (``post_process``) has the decoder's final norm, the output layer and the loss. Every stage keeps
    both relative position tables (tiny), whose gradients the pipeline sums over the stages.
    """

    def __init__(self, config: Any, pre_process: bool = True, post_process: bool = True,
                 layer_numbers: list[int] | None = None) -> None:
        super().__init__()
        args = T5Args.from_config(config)
        self.config = config
        self.args = args
        self.pre_process = pre_process
        self.post_process = post_process
        self.vocab_size = args.vocab_size
        self.share_embeddings_and_output_weights = args.share_embeddings_and_output_weights
        encoder_layers, decoder_layers = args.encoder_num_layers, args.decoder_num_layers
        numbers = list(range(encoder_layers + decoder_layers)) if layer_numbers is None else list(layer_numbers)
        self.embedding = nn.Module() if pre_process else None
        if pre_process:
            self._build_embedding(args)
        self.encoder_relative_pos_emb = None
        self.decoder_relative_pos_emb = None
        if args.position_embedding_type == "relative":
            self.encoder_relative_pos_emb = RelativePositionBias(args, bidirectional=True)
            self.decoder_relative_pos_emb = RelativePositionBias(args, bidirectional=False)
        # rope: one rotary table (no parameters) for both stacks' self-attention, as Megatron's T5
        self.rotary_pos_emb = None
        if args.position_embedding_type == "rope":
            self.rotary_pos_emb = RotaryEmbedding(
                args.kv_channels, rotary_percent=args.rotary_percent, rotary_base=args.rotary_base,
                seq_len_interpolation_factor=args.seq_len_interpolation_factor, interleaved=args.rotary_interleaved)
        encoder_numbers = [n for n in numbers if n < encoder_layers]
        self.encoder = T5Stack(args, encoder_layers, False, encoder_numbers, encoder_layers - 1 in encoder_numbers)
        decoder_numbers = [n - encoder_layers for n in numbers if n >= encoder_layers]
        self.decoder = T5Stack(args, decoder_layers, True, decoder_numbers, post_process)
        self.output_layer: nn.Linear | None = None
        if post_process and not args.share_embeddings_and_output_weights:
            self.output_layer = nn.Linear(args.hidden_size, args.vocab_size, bias=False, dtype=args.params_dtype)
            self.output_layer.init_std = args.init_method_std

    def _build_embedding(self, args: T5Args) -> None:
        self.embedding.word_embeddings = nn.Embedding(args.vocab_size, args.hidden_size, dtype=args.params_dtype)
        self.embedding.word_embeddings.init_std = args.embedding_init_method_std
        self.embedding.position_embeddings = None
        if args.position_embedding_type == "learned_absolute":
            table = nn.Embedding(args.max_position_embeddings, args.hidden_size, dtype=args.params_dtype)
            table.init_std = args.embedding_init_method_std
            self.embedding.position_embeddings = table
        self.embedding_dropout = nn.Dropout(args.hidden_dropout)

    def output_weight(self) -> torch.Tensor:
        """The output projection's weight: ``output_layer.weight``, or the word embeddings when tied."""
        return self.output_layer.weight if self.output_layer is not None else self.embedding.word_embeddings.weight

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Word (+ learned position) embeddings of ``input_ids`` ``[b, s]`` at ``positions`` (default
        ``0..s-1``), then dropout."""
        hidden = self.embedding.word_embeddings(input_ids)
        if self.embedding.position_embeddings is not None:
            if positions is None:
                positions = torch.arange(input_ids.shape[1], device=input_ids.device)
            hidden = hidden + self.embedding.position_embeddings(positions)[None]
        return self.embedding_dropout(hidden)

    def encode(self, encoder_input_ids: torch.Tensor, encoder_attn_mask: torch.Tensor | None = None,
               encoder_slice: SequenceSlice | None = None) -> torch.Tensor:
        """The encoder output ``[b, s_enc, hidden]`` (of the tokens ``encoder_slice`` holds, when given)."""
        tokens = encoder_slice or _whole(encoder_input_ids.shape[1], encoder_input_ids.device)
        return self._run_encoder(self.embed(encoder_input_ids, tokens.positions), encoder_attn_mask, tokens)

    def _run_encoder(self, hidden: torch.Tensor, encoder_attn_mask: torch.Tensor | None,
                     tokens: SequenceSlice) -> torch.Tensor:
        """This model's encoder layers (and final norm) on ``hidden``; the attention bias only where a layer
        needs it (a pipeline stage may hold none)."""
        if not len(self.encoder.layers):
            return self.encoder.final_norm(hidden)
        device = hidden.device
        position_bias = None
        if self.encoder_relative_pos_emb is not None:
            position_bias = self.encoder_relative_pos_emb(tokens.positions, torch.arange(tokens.length, device=device))
        band = self._window_band(tokens.positions, tokens.length, tokens.length, causal=False)
        bias = _stack_bias(self.encoder.layers, position_bias, _as_mask(encoder_attn_mask), band,
                           len(tokens.positions), tokens.length, hidden.dtype, device)
        return self.encoder(hidden, bias, rotary=self._rotary(tokens))

    def _window_band(self, query_positions: torch.Tensor, query_length: int, key_length: int,
                     causal: bool) -> torch.Tensor | None:
        """The sliding window's band (``window_band``), None without a window; ``causal``: no later keys."""
        window = self.args.window_size
        if window is None:
            return None
        return window_band(query_positions, query_length, key_length, window[0], 0 if causal else window[1])

    def _rotary(self, tokens: SequenceSlice) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(cos, sin)`` of the tokens' global positions with rotary positions, else None."""
        return None if self.rotary_pos_emb is None else self.rotary_pos_emb(tokens.positions[None])

    def forward(
        self,
        encoder_input_ids: torch.Tensor,
        decoder_input_ids: torch.Tensor,
        encoder_attn_mask: torch.Tensor | None = None,
        decoder_attn_mask: torch.Tensor | None = None,
        encoder_decoder_attn_mask: torch.Tensor | None = None,
        lm_labels: torch.Tensor | None = None,
        *,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_slice: SequenceSlice | None = None,
        decoder_slice: SequenceSlice | None = None,
        hidden_states: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run encoder and decoder.

        Args:
            encoder_input_ids, decoder_input_ids: ``[b, s_enc]`` / ``[b, s_dec]`` token ids.
            encoder_attn_mask: bool ``[b, 1, s_enc, s_enc]`` (True = masked); None = attend everywhere.
            decoder_attn_mask: bool ``[b, 1, s_dec, s_dec]``, combined with the causal mask the decoder always
                applies; None = causal only.
            encoder_decoder_attn_mask: bool ``[b, 1, s_dec, s_enc]``; None = attend to every encoder position.
            lm_labels: ``[b, s_dec]`` targets; when given, the float32 per-token loss ``[b, s_dec]`` is returned.
            encoder_hidden_states: a precomputed encoder output (generation), skipping the encoder.
            encoder_slice, decoder_slice: the part of each sequence the given ids (and mask rows, labels) hold
                (context parallel); None = the whole sequence.
            hidden_states: on a pipeline stage without ``pre_process``, the previous stage's output (else taken
                from the first positional argument, where ``torch.distributed.pipelining`` passes it).

        Returns logits ``[b, s_dec, padded_vocab]``, or the per-token loss with ``lm_labels``; a stage without
        ``post_process`` returns its ``[b, s_enc + s_dec, hidden]`` hidden states.
        """
        device = decoder_input_ids.device
        tokens = decoder_slice or _whole(decoder_input_ids.shape[1], device)
        if self.pre_process:
            if encoder_hidden_states is None:
                encoder_hidden_states = self.encode(encoder_input_ids, encoder_attn_mask, encoder_slice)
            hidden = self.embed(decoder_input_ids, tokens.positions)  # after the encoder: one process's draws
        else:
            received = encoder_input_ids if hidden_states is None else hidden_states
            split = received.shape[1] - len(tokens.positions)
            encoder_tokens = encoder_slice or _whole(split, device)
            encoder_hidden_states = self._run_encoder(received[:, :split], encoder_attn_mask, encoder_tokens)
            hidden = received[:, split:]
        s_enc = encoder_slice.length if encoder_slice is not None else encoder_hidden_states.shape[1]
        hidden = self._run_decoder(hidden, encoder_hidden_states, decoder_attn_mask, encoder_decoder_attn_mask,
                                   tokens, s_enc)
        if not self.post_process:
            return torch.cat([encoder_hidden_states, hidden], dim=1)
        return self._output(hidden, lm_labels)

    def _run_decoder(self, hidden: torch.Tensor, encoder_output: torch.Tensor, decoder_attn_mask: Any,
                     encoder_decoder_attn_mask: Any, tokens: SequenceSlice, s_enc: int) -> torch.Tensor:
        """This model's decoder layers (and final norm) on ``hidden``, cross-attending to ``encoder_output``."""
        if not len(self.decoder.layers):
            return self.decoder.final_norm(hidden)
        device = hidden.device
        s_dec, dtype = len(tokens.positions), hidden.dtype
        keys = torch.arange(tokens.length, device=device)
        self_mask = (keys[None, :] > tokens.positions[:, None])[None, None]  # causal, on global positions
        if decoder_attn_mask is not None:  # the decoder is always causal; a given mask is applied on top
            self_mask = self_mask | _as_mask(decoder_attn_mask)
        position_bias = None
        if self.decoder_relative_pos_emb is not None:
            position_bias = self.decoder_relative_pos_emb(tokens.positions, keys)
        self_band = self._window_band(tokens.positions, tokens.length, tokens.length, causal=True)
        self_bias = _stack_bias(self.decoder.layers, position_bias, self_mask, self_band, s_dec, tokens.length,
                                dtype, device)
        cross_band = self._window_band(tokens.positions, tokens.length, s_enc, causal=False)
        cross_bias = _stack_bias(self.decoder.layers, None, _as_mask(encoder_decoder_attn_mask), cross_band, s_dec,
                                 s_enc, dtype, device)
        return self.decoder(hidden, self_bias, encoder_output, cross_bias, rotary=self._rotary(tokens))

    def _output(self, hidden: torch.Tensor, lm_labels: torch.Tensor | None) -> torch.Tensor:
        """Logits of the decoder output, or with ``lm_labels`` the float32 per-token loss."""
        if self.args.scale_decoder_outputs:
            hidden = hidden * (self.args.hidden_size**-0.5)
        if self.output_layer is not None:
            logits = self.output_layer(hidden)  # as a module, so tensor-parallel hooks run
        else:
            logits = F.linear(hidden, self.embedding.word_embeddings.weight)
        if lm_labels is None:
            return logits
        flat = logits.flatten(0, 1)
        if not self.args.fp16_lm_cross_entropy:
            flat = flat.float()
        loss = F.cross_entropy(flat, lm_labels.flatten(0, 1), reduction="none")
        return loss.float().view(lm_labels.shape)


def build_t5_model(
    provider: Any,
    *,
    seed: int | None = None,
    materialize: bool = True,
    device: torch.device | str | None = None,
    pre_process: bool = True,
    post_process: bool = True,
    layer_numbers: list[int] | None = None,
) -> T5Model:
    """Build a ``T5Model`` (or a pipeline stage of one: see ``T5Model``) on the meta device and (by default)
    materialize and initialize it from ``seed`` (default ``torch.initial_seed()``); ``materialize=False``
    leaves it on meta for the parallel plans."""
    with torch.device("meta"):
        model = T5Model(provider, pre_process, post_process, layer_numbers)
    return materialize_model(model, provider, seed, device) if materialize else model
