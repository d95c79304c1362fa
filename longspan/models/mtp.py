"""Multi-token prediction (MTP): megatron-core's ``MultiTokenPredictionBlock`` in plain PyTorch.

With ``mtp_num_layers = D`` the last pipeline stage holds ``D`` extra modules after the decoder. Depth ``k``
(1-based) predicts the token ``k + 1`` places ahead: it takes the previous depth's hidden states (depth 1: the
decoder's output, after its final norm) and the embedding of the input ids shifted left by ``k``, and runs::

    h = eh_proj(cat([enorm(embed(roll(ids, k))), hnorm(h_prev)], -1))     # [b, s, 2h] -> [b, s, h]
    h = final_layernorm(transformer_layer(h, rotary, mask))

The output layer is shared with the main head; the depth's loss is the cross-entropy against the labels
shifted left by ``k`` under the loss mask shifted the same way (``roll_left``: the vacated last position gets
id 0 / mask 0; with packed sequences, ``cu_seqlens``, the last token of every document as well, so no
prediction crosses a document boundary, as megatron-core's packed roll). Per depth and microbatch::

    mtp_loss_k = sum(mask_k * ce_k) / max(sum(mask_k), 1)    (logged as "mtp_{k} loss")
    objective += mtp_loss_scaling_factor / D * mtp_loss_k    (gradient only, through MTPLossAutoScaler)

With ``calculate_per_token_loss`` the depth's sum is not divided by its token count (megatron-core). The loss
joins the gradients through ``MTPLossAutoScaler`` attached to the main head's input, so the model's return
value (the main per-token loss) and the logged ``lm loss`` stay the main loss. The trainer's schedule sets the
autoscaler's gradient scale as it does the MoE aux losses' (``loss_scale / num_microbatches``).

Under context parallel each rank holds two chunks of every sequence (``longspan.parallel.context_parallel``), so
a shift crosses chunk boundaries. The plan installs a ``SequenceChunks`` (``block.sequence_chunks``; the model
holds no process group): the depths gather the whole token ids, positions, labels and loss mask (the ones the
model got sliced), shift them on the whole sequence, embed and score this rank's chunks, and gather the
per-token losses back to the whole sequence, as the main loss is gathered. Every rank then computes the
one-process loss, and the gathers' backward gives each rank ``cp ×`` its share of the gradient, which the
gradient average over data × context parallel brings back (as for the main loss). The hidden states stay
local: depth ``k``'s state at a position depends only on the previous depth's state there and on attention,
which the context-parallel attention makes exact. Under sequence parallel the depths' norms and projection
work on sequence shards (``longspan.parallel.tensor_parallel``) and the shared output layer gathers its input
as the main head's does.

Under pipeline parallelism the depths sit on the last stage, which keeps its own copy of the embedding
(``GPTModel``; ``longspan.parallel.pipeline`` keeps it equal to the first stage's) and receives the token ids as
``token_ids``. The transformer layer of each depth is built like the decoder's last layer (dense or MoE, its window); its
layer number is ``num_layers + k - 1`` (0-based), after the decoder's. The rotary tables and attention mask
are the decoder's; the shifted position ids feed learned absolute position embeddings only.

Module names (megatron-core's)::

    mtp.layers.{k-1}.enorm / hnorm              norm over hidden (as the decoder's norms)
    mtp.layers.{k-1}.eh_proj                    nn.Linear [hidden, 2 * hidden], bias-free
    mtp.layers.{k-1}.transformer_layer.*        a TransformerLayer (same sub-module names as decoder layers)
    mtp.layers.{k-1}.final_layernorm

HF DeepSeek-V3 checkpoints store depth ``k`` as decoder layer ``num_hidden_layers + k - 1``::

    model.layers.{L}.enorm.weight                   -> mtp.layers.{k-1}.enorm.weight
    model.layers.{L}.hnorm.weight                   -> mtp.layers.{k-1}.hnorm.weight
    model.layers.{L}.eh_proj.weight                 -> mtp.layers.{k-1}.eh_proj.weight   ([h, 2h]: the first
                                                       h input columns read the embedding, the rest the hidden)
    model.layers.{L}.shared_head.norm.weight        -> mtp.layers.{k-1}.final_layernorm.weight
    model.layers.{L}.shared_head.head.weight        -> not stored here: the shared output_layer (equal to it)
    model.layers.{L}.embed_tokens.weight            -> not stored here: the shared word embeddings
    model.layers.{L}.{input_layernorm, self_attn.*, post_attention_layernorm, mlp.*}
                                                    -> mtp.layers.{k-1}.transformer_layer.* with the decoder
                                                       layer's mapping (same names as decoder.layers.{i}.*)
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Protocol

import torch
from torch import nn

from longspan.models.args import TransformerArgs
from longspan.models.local import local_tensor
from longspan.models.moe_router import in_backward_pass
from longspan.models.transformer import TransformerLayer, build_norm, layer_masks

PerTokenLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (hidden [b,s,h], labels [b,s]) -> [b,s]


class SequenceChunks(Protocol):
    """This rank's part of every sequence under context parallel (``longspan.parallel.context_parallel``)."""

    def whole(self, tensor: torch.Tensor, local_len: int) -> torch.Tensor:
        """``tensor [b, s]`` over the whole sequence: gathered (differentiably) when it holds ``local_len``
        positions, else returned as it is (already whole)."""

    def local(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's positions of a whole-sequence ``tensor [b, S]``."""


def roll_left(tensor: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``tensor [b, s]`` shifted one place left along the sequence, the vacated last position set to 0
    (megatron-core's ``roll_tensor(shifts=-1)``). With ``cu_seqlens`` (``[b, n]`` or ``[n]`` document starts and
    the end, repeated values allowed) the last position of every document is zeroed too, so nothing moves
    across a document boundary (megatron-core's packed-sequence roll)."""
    rolled = torch.roll(tensor, shifts=-1, dims=-1)
    rolled[..., -1] = 0
    if cu_seqlens is None:
        return rolled
    seq_len = tensor.shape[-1]
    bounds = cu_seqlens.to(torch.long)
    bounds = bounds.expand(tensor.shape[0], -1) if bounds.dim() == 1 else bounds
    nonempty = bounds[:, 1:] > bounds[:, :-1]
    ends = bounds[:, 1:] - 1  # the last token of each document
    keep = nonempty & (ends >= 0) & (ends < seq_len)
    rows = torch.arange(tensor.shape[0], device=tensor.device).unsqueeze(1).expand_as(ends)
    rolled[rows[keep], ends[keep]] = 0
    return rolled


class MTPLossAutoScaler(torch.autograd.Function):
    """Attach the MTP loss to an activation: forward returns the activation; backward also sends
    ``main_loss_backward_scale`` as the MTP loss's gradient (megatron-core's class of the same name)."""

    main_loss_backward_scale: Optional[torch.Tensor] = None

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, mtp_loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(mtp_loss)
        return output

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (mtp_loss,) = ctx.saved_tensors
        scale = MTPLossAutoScaler.main_loss_backward_scale
        scale = 1.0 if scale is None else scale.to(mtp_loss.device)
        return grad_output, torch.ones_like(mtp_loss) * scale

    @staticmethod
    def set_loss_scale(scale: float) -> None:
        """Set the gradient the MTP loss receives (the main loss's scale / number of microbatches)."""
        MTPLossAutoScaler.main_loss_backward_scale = torch.tensor(float(scale), dtype=torch.float32)


class MultiTokenPredictionLayer(nn.Module):
    """One MTP depth: ``enorm``, ``hnorm``, ``eh_proj``, ``transformer_layer``, ``final_layernorm``."""

    def __init__(self, config: TransformerArgs, depth: int) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.enorm = build_norm(config, hidden)
        self.hnorm = build_norm(config, hidden)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False, dtype=config.params_dtype)
        self.eh_proj.init_std = config.init_method_std
        # the decoder's last layer's kind (dense / MoE, window), numbered after the decoder's layers
        self.transformer_layer = TransformerLayer(config, config.num_layers - 1)
        _renumber(self.transformer_layer, config.num_layers + depth - 1)
        self.final_layernorm = build_norm(config, hidden)

    def forward(self, hidden_states: torch.Tensor, embeddings: torch.Tensor, rotary: Any,
                attention_mask: Any) -> torch.Tensor:
        projected = self.eh_proj(torch.cat([self.enorm(embeddings), self.hnorm(hidden_states)], dim=-1))
        mask = layer_masks([self.transformer_layer], attention_mask)[0]
        return self.final_layernorm(self.transformer_layer(projected, rotary, mask))


def _renumber(layer: TransformerLayer, layer_number: int) -> None:
    """Give an MTP depth's layer (and its attention / MoE sub-modules) its own layer number."""
    layer.layer_number = layer_number
    layer.self_attention.layer_number = layer_number
    if hasattr(layer.mlp, "layer_number"):
        layer.mlp.layer_number = layer_number


class MultiTokenPredictionBlock(nn.Module):
    """The ``D`` MTP depths (``layers``) and their loss. ``forward`` returns the main head's input with the
    scaled MTP loss attached (``MTPLossAutoScaler``); while training it also accumulates each depth's
    ``sum(mask * ce) / sum(mask)`` for the log (``take_losses``)."""

    def __init__(self, config: TransformerArgs) -> None:
        super().__init__()
        self.num_layers = int(config.mtp_num_layers)
        self.loss_scaling_factor = float(config.mtp_loss_scaling_factor or 0.0)
        self.calculate_per_token_loss = bool(config.calculate_per_token_loss)
        self.layers = nn.ModuleList(MultiTokenPredictionLayer(config, k + 1) for k in range(self.num_layers))
        # Installed by the context-parallel plan: the sequence is split over ranks (see the module docstring).
        self.sequence_chunks: Optional[SequenceChunks] = None
        self.reset_losses()

    def reset_losses(self) -> None:
        """Clear the accumulated per-depth losses (done after each logged iteration)."""
        self.loss_sums = [0.0] * self.num_layers  # Python floats: the block may be built on the meta device
        self.loss_steps = 0

    def take_losses(self) -> tuple[list[float], int]:
        """(per-depth sums of the microbatch losses since the last reset, microbatches counted), then reset."""
        sums, steps = self.loss_sums, self.loss_steps
        self.reset_losses()
        return sums, steps

    def depth_losses(self, hidden_states: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor,
                     labels: torch.Tensor, loss_mask: Optional[torch.Tensor], embed: Callable[..., torch.Tensor],
                     per_token_loss: PerTokenLoss, rotary: Any, attention_mask: Any,
                     cu_seqlens: Optional[torch.Tensor] = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per depth: (masked per-token losses ``[b, S]`` of the whole sequence, number of unmasked tokens)."""
        chunks = self.sequence_chunks
        position_ids = position_ids.expand(labels.shape[0], -1) if position_ids.shape[0] != labels.shape[0] \
            else position_ids
        if chunks is not None:  # context parallel: shift the whole sequence, then keep this rank's chunks
            local_len = labels.shape[-1]
            input_ids, position_ids, labels = (chunks.whole(t, local_len) for t in (input_ids, position_ids, labels))
            loss_mask = None if loss_mask is None else chunks.whole(loss_mask, local_len)
        here = (lambda t: t) if chunks is None else chunks.local
        mask = torch.ones_like(labels) if loss_mask is None else loss_mask
        out = []
        for layer in self.layers:
            input_ids = roll_left(input_ids, cu_seqlens)
            position_ids = roll_left(position_ids, cu_seqlens)
            labels = roll_left(labels, cu_seqlens)
            mask = roll_left(mask, cu_seqlens)
            hidden_states = layer(hidden_states, embed(here(input_ids), here(position_ids)), rotary, attention_mask)
            # under tensor parallel the vocab-parallel loss is a replicated DTensor: its local value is the loss
            losses = local_tensor(per_token_loss(hidden_states, here(labels)))
            if chunks is not None:
                losses = chunks.whole(losses, local_len)
            losses = losses * mask.float()
            out.append((losses, mask.float().sum()))
        return out

    def forward(self, hidden_states: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """``hidden_states`` (the main head's input) with the MTP loss attached; ``kwargs`` as ``depth_losses``."""
        per_depth = self.depth_losses(hidden_states, **kwargs)
        scale = self.loss_scaling_factor / self.num_layers
        track = self.training and torch.is_grad_enabled() and not in_backward_pass()
        for k, (losses, num_tokens) in enumerate(per_depth):
            total = losses.sum()
            num_tokens = num_tokens.clamp(min=1)  # a fully masked microbatch adds 0, not NaN (megatron-core)
            if track:
                self.loss_sums[k] += float((total / num_tokens).detach())
            objective = scale * total if self.calculate_per_token_loss else scale * total / num_tokens
            hidden_states = MTPLossAutoScaler.apply(hidden_states, objective)
        if track:
            self.loss_steps += 1
        return hidden_states


def mtp_blocks(model: nn.Module | list[nn.Module]) -> list[MultiTokenPredictionBlock]:
    """The MTP blocks of a model (or of a list of model chunks)."""
    chunks = model if isinstance(model, list) else [model]
    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, MultiTokenPredictionBlock)]


def set_mtp_loss_scale(scale: float) -> None:
    """The scale the schedule gives the MTP loss's gradient: the main loss's scale / number of microbatches."""
    MTPLossAutoScaler.set_loss_scale(scale)
