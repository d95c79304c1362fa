"""Context parallel: each sequence split across the ``cp`` ranks, with exact attention over the whole of it.

Layout (Megatron's load balancing for causal attention): a sequence of ``S`` tokens is cut into ``2·cp``
chunks of ``c = S / (2·cp)`` tokens and rank ``r`` keeps chunks ``r`` and ``2·cp−1−r``. An early chunk sees
few keys and a late one many, so every rank does the same amount of causal attention work::

    cp = 2, S = 8:   chunks  0 1 2 3   ->  rank 0: tokens 0,1 + 6,7    rank 1: tokens 2,3 + 4,5

Attention (``context_parallel_attention``): each rank all-gathers K and V (only the ``num_query_groups``
kv heads, before they are repeated for grouped-query attention), puts them back in sequence order, and
attends its local queries to them: each of its two query chunks against the keys up to the chunk's end
with a bottom-right-aligned causal mask (``causal_lower_right``: flash/efficient kernels on CUDA; on CPU,
whose flash kernel aligns causal masks top-left only, the diagonal block and the prefix are two flash
calls merged by their log-sum-exps, see ``_PrefixCausalAttention``). The backward pass is autograd's, through a differentiable all-gather whose backward is the matching
reduce-scatter (sum of every rank's K/V gradients, each rank keeping its chunks), so forward and backward
are exact. An explicit attention mask (``reset_attention_mask``: document masks) works too: its query rows
are this rank's tokens and its key columns the whole sequence. A sliding-window layer (its mask a
``longspan.models.sliding_window.WindowedMask``) applies the window on the global positions and attends each
query chunk only to the key chunks its window reaches: chunks wholly before it are skipped
(``WINDOW_BLOCKS`` counts them), so its work per rank grows with the window, not the sequence. Everything
runs on ``torch.distributed`` collectives: gloo on CPU and NCCL on GPU alike.

The plan (``apply_context_parallel``) keeps the model plain: it replaces ``SelfAttention.core_attention``
on every layer and hooks the root ``GPTModel`` so that

- the model is called with **full-length** ``input_ids`` / ``position_ids`` / ``labels`` / ``attention_mask``
  (what the default forward step passes) and keeps this rank's two chunks of each (``position_ids`` default
  to the global positions, so RoPE and learned position embeddings follow the split; mRoPE's ``[3, b, S]``
  ids are cut along their last dim), and of ``decoder_input`` when given;
- a vision-language model (Megatron's way: the sequence is split after the image merge) gets the plan on its
  ``language_model``: the images go into the whole sequence's embeddings and its positions are numbered on the
  whole sequence before the language model keeps its chunks;
- its per-token loss ``[b, s_local]`` is all-gathered back to ``[b, S]`` in sequence order, with a
  reduce-scatter backward. Every cp rank then computes the same loss from the full ``loss_mask`` (no change
  to the forward step or ``loss_func``), the reports and token counts are those of the whole sequence, and
  the backward gives each rank ``cp ×`` its share of the gradient, which the data-parallel average over
  ``dp × cp`` brings back to the exact gradient. The loss maths therefore does not depend on the layout
  (no "multiply by cp" in the schedule, unlike Megatron, whose loss is per cp rank).

Mamba-2 mixers scan the whole sequence: each gets an all-to-all exchange (``mamba_context_parallel``) that
gives every rank the whole sequence of a share of the heads between ``in_proj`` and ``out_proj``; gated DeltaNet
mixers get the same exchange between their projections (``longspan.parallel.gated_delta_net``, which says why
not a state passed between the chunks), and read packed documents' ``cu_seqlens``, left whole-sequence, there.

MoE layers are token-wise and need nothing but their losses' statistics: every router gets a
``longspan.models.moe_router.SequenceShards`` (the cp size and a sum over the cp group), with which the load-balancing
loss counts the whole sequence's tokens per expert. Multi-token prediction shifts tokens across chunk
boundaries: its block gets a ``ContextParallelSequence`` (``longspan.models.mtp``), with which it shifts the
whole gathered sequence and gathers its per-token losses like the main ones.

Pipeline stages: a stage without ``pre_process`` receives hidden states that are already local (they are
not sliced; the full length is read from full-length ``position_ids`` or ``labels`` when given, else
``model.args.seq_length``); a stage without ``post_process`` returns local hidden states (not gathered). A
last stage should get ``labels`` so that per-token losses, not logits, are gathered.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from longspan.core.errors import ConfigError, NotSupportedError
from longspan.core.logging import get_logger
from longspan.models.attention import repeat_kv
from longspan.models.moe import moe_layers
from longspan.models.moe_router import SequenceShards
from longspan.models.sliding_window import TwoSidedMask, WindowedMask, windowed_attention
from longspan.parallel.gated_delta_net import apply_gated_delta_net_context_parallel
from longspan.parallel.mamba_context_parallel import apply_mamba_context_parallel

_log = get_logger(__name__)

#: attribute set on the root model once the plan is applied (guards against applying it twice)
CONTEXT_PARALLEL_ATTR = "_longspan_context_parallel"
#: the batch entries split along the sequence (dim 1); ``attention_mask`` is split along its query rows
SEQUENCE_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


# ------------------------------------------------------------------------------------------ the layout

def load_balanced_indices(
    seq_len: int, cp_size: int, cp_rank: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """Global positions held by ``cp_rank``: chunk ``cp_rank`` then chunk ``2·cp−1−cp_rank`` of ``2·cp``.

    Raises ``ConfigError`` when ``seq_len`` is not a multiple of ``2·cp_size``.
    """
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank} is not a rank of a context-parallel group of {cp_size}")
    if seq_len % (2 * cp_size):
        raise ConfigError(
            f"sequence length {seq_len} is not divisible by 2 x context_parallel_size ({2 * cp_size}); "
            f"use a multiple of {2 * cp_size} (model.seq_length / dataset.sequence_length)"
        )
    chunk = seq_len // (2 * cp_size)
    early = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    late_start = (2 * cp_size - 1 - cp_rank) * chunk
    late = torch.arange(late_start, late_start + chunk, device=device)
    return torch.cat([early, late])


def split_for_context_parallel(tensor: torch.Tensor, cp_size: int, cp_rank: int, seq_dim: int = 1) -> torch.Tensor:
    """This rank's two chunks of ``tensor`` along ``seq_dim`` (a copy; differentiable)."""
    if cp_size == 1:
        return tensor
    idx = load_balanced_indices(tensor.shape[seq_dim], cp_size, cp_rank, device=tensor.device)
    return tensor.index_select(seq_dim, idx)


def slice_batch_for_context_parallel(batch: dict[str, Any], cp_size: int, cp_rank: int) -> dict[str, Any]:
    """A batch dict with ``tokens``, ``labels``, ``loss_mask`` and ``position_ids`` cut to this rank's chunks.

    ``position_ids`` are created (``arange``) when absent, so the slice keeps the global positions;
    ``attention_mask`` ``[b or 1, 1, S, S]`` keeps this rank's query rows and every key column. For custom
    forward steps that call a model *without* the plan's input hooks (the plan itself slices full-length
    inputs, so do not slice twice).
    """
    if cp_size == 1:
        return dict(batch)
    out = dict(batch)
    tokens = batch.get("tokens")
    if tokens is not None and batch.get("position_ids") is None:
        out["position_ids"] = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)
    for key in SEQUENCE_KEYS:
        if out.get(key) is not None:
            out[key] = split_for_context_parallel(out[key], cp_size, cp_rank, seq_dim=1)
    if batch.get("attention_mask") is not None:
        out["attention_mask"] = split_for_context_parallel(batch["attention_mask"], cp_size, cp_rank, seq_dim=-2)
    return out


# ------------------------------------------------------------------------ differentiable all-gather

def _rank_major_to_sequence(parts: list[torch.Tensor], seq_dim: int) -> torch.Tensor:
    """Each rank's ``[chunk r, chunk 2cp−1−r]`` (in rank order) -> the sequence in order."""
    cp = len(parts)
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for r, part in enumerate(parts):
        early, late = part.chunk(2, dim=seq_dim)
        chunks[r], chunks[2 * cp - 1 - r] = early, late
    return torch.cat(chunks, dim=seq_dim)  # type: ignore[arg-type]


def _sequence_to_rank_major(full: torch.Tensor, cp: int, seq_dim: int) -> list[torch.Tensor]:
    """Inverse of ``_rank_major_to_sequence``: rank r's ``[chunk r, chunk 2cp−1−r]`` for every r."""
    chunks = full.chunk(2 * cp, dim=seq_dim)
    return [torch.cat([chunks[r], chunks[2 * cp - 1 - r]], dim=seq_dim) for r in range(cp)]


class _GatherSequence(torch.autograd.Function):
    """All-gather of load-balanced sequence chunks into sequence order; backward: the reduce-scatter."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: Any, seq_dim: int) -> torch.Tensor:
        ctx.group, ctx.seq_dim = group, seq_dim
        cp = dist.get_world_size(group)
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(cp)]
        dist.all_gather(parts, local, group=group)
        return _rank_major_to_sequence(parts, seq_dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        group, seq_dim = ctx.group, ctx.seq_dim
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        per_rank = _sequence_to_rank_major(grad, cp, seq_dim)
        if grad.is_cuda:
            stacked = torch.stack(per_rank).contiguous()
            mine = torch.empty_like(per_rank[0])
            dist.reduce_scatter_tensor(mine, stacked, group=group)
            return mine, None, None
        # gloo has no reduce-scatter: all-reduce the (rank-major) gradient and keep this rank's part
        stacked = torch.stack(per_rank).contiguous()
        dist.all_reduce(stacked, group=group)
        return stacked[rank], None, None


def gather_sequence(local: torch.Tensor, group: Any, seq_dim: int = 1) -> torch.Tensor:
    """The full sequence from every cp rank's load-balanced chunks (autograd: backward reduce-scatters).

    With ``group`` None or of size 1 ``local`` is returned unchanged.
    """
    if group is None or dist.get_world_size(group) == 1:
        return local
    return _GatherSequence.apply(local, group, seq_dim % local.dim())


# ---------------------------------------------------------------------------------------- attention

class _PrefixCausalAttention(torch.autograd.Function):
    """One query chunk against keys ``[0, end)``, causal inside its own (last) key chunk, on CPU kernels.

    torch's CPU flash kernel only aligns causal masks top-left, so the chunk is done as two flash calls —
    the diagonal block (square, causal) and the prefix (no mask) — merged by their log-sum-exps; the
    backward runs the flash backward of each block with the merged output and log-sum-exp, which gives each
    block's exact share of the gradients (the ring/flash-attention identity). O(s) memory instead of the
    masked path's [chunk, end] scores.
    """

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: int,
                scale: float | None) -> torch.Tensor:
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        prefix = k.shape[2] - chunk
        out, lse = flash(q, k[:, :, prefix:], v[:, :, prefix:], 0.0, True, scale=scale)
        if prefix:
            out_p, lse_p = flash(q, k[:, :, :prefix], v[:, :, :prefix], 0.0, False, scale=scale)
            merged = torch.logaddexp(lse, lse_p)
            acc = torch.promote_types(q.dtype, torch.float32)  # merge in at least fp32 (bf16 inputs)
            out = (out.to(acc) * torch.exp(lse - merged).unsqueeze(-1).to(acc)
                   + out_p.to(acc) * torch.exp(lse_p - merged).unsqueeze(-1).to(acc)).to(q.dtype)
            lse = merged
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.chunk, ctx.scale = chunk, scale
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        q, k, v, out, lse = ctx.saved_tensors
        prefix = k.shape[2] - ctx.chunk
        grad = grad.contiguous()
        dq, dk_d, dv_d = backward(grad, q, k[:, :, prefix:], v[:, :, prefix:], out, lse, 0.0, True,
                                  scale=ctx.scale)
        if not prefix:
            return dq, dk_d, dv_d, None, None
        dq_p, dk_p, dv_p = backward(grad, q, k[:, :, :prefix], v[:, :, :prefix], out, lse, 0.0, False,
                                    scale=ctx.scale)
        return dq + dq_p, torch.cat([dk_p, dk_d], dim=2), torch.cat([dv_p, dv_d], dim=2), None, None


def _use_cpu_flash(q: torch.Tensor, dropout_p: float) -> bool:
    return (q.device.type == "cpu" and dropout_p == 0.0 and USE_CPU_FLASH
            and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward"))


#: use the two-block CPU flash path for causal attention on CPU (False: the masked SDPA path everywhere)
USE_CPU_FLASH = True


def local_attention(
    q: torch.Tensor,
    k_full: torch.Tensor,
    v_full: torch.Tensor,
    cp_size: int,
    cp_rank: int,
    attention_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of this rank's queries ``[b, heads, 2c, d]`` to the whole sequence's keys/values.

    ``k_full`` / ``v_full`` are ``[b, groups, S, d]`` in sequence order. ``attention_mask`` (bool, True =
    masked) is ``None`` for causal attention, or ``[b or 1, 1, 2c or S, S]`` (rows: this rank's queries, or
    all queries, which are then sliced). No communication: ``context_parallel_attention`` gathers first.
    """
    n_rep = q.shape[1] // k_full.shape[1]
    k_full, v_full = repeat_kv(k_full, n_rep), repeat_kv(v_full, n_rep)
    seq_len, local_len = k_full.shape[2], q.shape[2]
    if local_len * cp_size != seq_len:
        raise ValueError(f"{local_len} local queries × cp {cp_size} != {seq_len} keys")
    if isinstance(attention_mask, WindowedMask):
        return _windowed_local_attention(q, k_full, v_full, cp_size, cp_rank, attention_mask, dropout_p, scale)
    if attention_mask is not None:
        if attention_mask.dtype != torch.bool:  # a 0/1 (or additive 0/-inf) mask: non-zero means masked
            attention_mask = attention_mask != 0
        if attention_mask.shape[-2] == seq_len and seq_len != local_len:
            attention_mask = split_for_context_parallel(attention_mask, cp_size, cp_rank, seq_dim=-2)
        return F.scaled_dot_product_attention(q, k_full, v_full, attn_mask=~attention_mask, dropout_p=dropout_p,
                                              scale=scale)
    chunk = local_len // 2
    outs = []
    # Chunk j (global index) attends keys [0, (j+1)·c): causal within its own chunk, full before it.
    for part, j in ((q[:, :, :chunk], cp_rank), (q[:, :, chunk:], 2 * cp_size - 1 - cp_rank)):
        end = (j + 1) * chunk
        if _use_cpu_flash(q, dropout_p):
            outs.append(_PrefixCausalAttention.apply(part.contiguous(), k_full[:, :, :end].contiguous(),
                                                     v_full[:, :, :end].contiguous(), chunk, scale))
            continue
        # Bottom-right-aligned causal mask: flash/memory-efficient kernels on CUDA, a materialized mask on CPU.
        from torch.nn.attention.bias import causal_lower_right  # a heavy import (~70 MB), only when needed

        bias = causal_lower_right(chunk, end)
        outs.append(F.scaled_dot_product_attention(part, k_full[:, :, :end], v_full[:, :, :end], attn_mask=bias,
                                                   dropout_p=dropout_p, scale=scale))
    return torch.cat(outs, dim=2)


#: key blocks (sequence chunks of ``S / (2·cp)`` tokens) that sliding-window layers attended ("computed") and
#: skipped because they lie wholly before every query's window ("skipped"), summed over calls on this process
WINDOW_BLOCKS = {"computed": 0, "skipped": 0}


def _windowed_local_attention(
    q: torch.Tensor,
    k_full: torch.Tensor,
    v_full: torch.Tensor,
    cp_size: int,
    cp_rank: int,
    mask: WindowedMask,
    dropout_p: float,
    scale: float | None,
) -> torch.Tensor:
    """A sliding-window layer's ``local_attention``: each of this rank's query chunks (global chunk j) attends to
    the key chunks from the first one its window reaches up to chunk j, with the window applied on the global
    positions (keys end at the chunk's last query, as ``windowed_attention`` expects). Key chunks wholly before
    the window are neither sliced nor computed (``WINDOW_BLOCKS`` counts them). A two-sided mask
    (``causal=False``: Gemma 3's image tokens see the later tokens of their image) lets a query reach keys after
    its chunk, so its keys run to the end of the sequence, the caller's mask deciding the later ones."""
    seq_len, local_len = k_full.shape[2], q.shape[2]
    chunk = local_len // 2
    base = mask.base
    if base is not None and base.shape[-2] == seq_len and seq_len != local_len:
        base = split_for_context_parallel(base, cp_size, cp_rank, seq_dim=-2)
    outs = []
    for row, j in ((0, cp_rank), (chunk, 2 * cp_size - 1 - cp_rank)):
        end = (j + 1) * chunk if mask.causal else seq_len
        first_block = max(0, j * chunk - mask.window + 1) // chunk
        WINDOW_BLOCKS["skipped"] += first_block
        WINDOW_BLOCKS["computed"] += end // chunk - first_block
        keys = slice(first_block * chunk, end)
        part_q = q[:, :, row:row + chunk]
        part_base = None if base is None else base[..., row:row + chunk, keys]
        if mask.causal:
            outs.append(windowed_attention(part_q, k_full[:, :, keys], v_full[:, :, keys], mask, dropout_p, scale,
                                           base=part_base))
            continue
        # query i of the chunk sits at key index j·c − keys.start + i; the window masks only keys too far back
        band = mask.band(chunk, end - keys.start, j * chunk - keys.start, q.device)
        keep = ~(band[None, None] | part_base)
        outs.append(F.scaled_dot_product_attention(part_q, k_full[:, :, keys], v_full[:, :, keys], attn_mask=keep,
                                                   dropout_p=dropout_p, scale=scale))
    return torch.cat(outs, dim=2)


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout_p: float,
    scale: float | None,
    group: Any,
) -> torch.Tensor:
    """Exact attention for load-balanced local ``[b, heads, 2c, d]`` q and ``[b, groups, 2c, d]`` k/v.

    Gathers K/V (kv groups only) over ``group`` and runs ``local_attention``; returns this rank's output
    ``[b, heads, 2c, d]``. Same arguments as ``longspan.models.attention.core_attention`` plus the group.
    """
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    k_full = gather_sequence(k, group, seq_dim=2)
    v_full = gather_sequence(v, group, seq_dim=2)
    return local_attention(q, k_full, v_full, cp, rank, attention_mask, dropout_p, scale)


class ContextParallelAttention:
    """Drop-in ``SelfAttention.core_attention`` running ``context_parallel_attention`` over ``group``.

    A plain callable, not an ``nn.Module``: it has no parameters and should not appear in module trees.
    """

    def __init__(self, group: Any) -> None:
        self.group = group

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attention_mask: torch.Tensor | None,
        dropout_p: float,
        scale: float | None,
    ) -> torch.Tensor:
        return context_parallel_attention(q, k, v, attention_mask, dropout_p, scale, self.group)

    def __repr__(self) -> str:
        return "ContextParallelAttention(all-gather K/V)"


# ------------------------------------------------------------------------- MoE and multi-token prediction

class GroupSum:
    """``SequenceShards.sum`` over a cp group: a copy of the tensor all-reduced (summed), no gradient."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        total = tensor.detach().clone()
        dist.all_reduce(total, group=self.group)
        return total


class ContextParallelSequence:
    """``longspan.models.mtp.SequenceChunks`` over a cp group: whole sequences gathered from every rank's
    load-balanced chunks (differentiably, ``gather_sequence``) and this rank's chunks cut from them."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def whole(self, tensor: torch.Tensor, local_len: int) -> torch.Tensor:
        """``tensor [b, s]``: gathered along dim 1 when it holds ``local_len`` positions, else returned as is."""
        if tensor.shape[1] != local_len:
            return tensor
        return gather_sequence(tensor, self.group, seq_dim=1)

    def local(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's two chunks of a whole-sequence ``tensor [b, S]``."""
        return split_for_context_parallel(tensor, dist.get_world_size(self.group), dist.get_rank(self.group))

    def __repr__(self) -> str:
        return "ContextParallelSequence(all-gather)"


def _install_sequence_shards(root: nn.Module, group: Any) -> None:
    """Routers count the whole sequence's tokens; multi-token prediction shifts the whole sequence."""
    shards = SequenceShards(size=dist.get_world_size(group), sum=GroupSum(group))
    for layer in moe_layers(root):
        layer.router.sequence_shards = shards
    mtp = getattr(root, "mtp", None)
    if mtp is not None:
        mtp.sequence_chunks = ContextParallelSequence(group)


# --------------------------------------------------------------------------------------------- the plan

_FORWARD_ARGS = ("input_ids", "position_ids", "attention_mask", "labels")


def _unwrap(model: nn.Module) -> nn.Module:
    while not hasattr(model, "decoder") and hasattr(model, "module"):
        model = model.module  # DDP and similar wrappers
    return model


def _slice_inputs(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Forward pre-hook: keep this rank's chunks of the full-length inputs."""
    group = getattr(module, CONTEXT_PARALLEL_ATTR)
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    kwargs = dict(kwargs)
    for name, value in zip(_FORWARD_ARGS, args):
        kwargs[name] = value
    if len(args) > len(_FORWARD_ARGS):
        raise TypeError(f"GPTModel.forward takes at most {len(_FORWARD_ARGS)} positional arguments")
    if getattr(module, "pre_process", True):
        first = kwargs["input_ids"]
        seq_len = first.shape[1]
        kwargs["input_ids"] = split_for_context_parallel(first, cp, rank, seq_dim=1)
        if kwargs.get("decoder_input") is not None:  # a vision-language model's embeddings, images put in
            kwargs["decoder_input"] = split_for_context_parallel(kwargs["decoder_input"], cp, rank, seq_dim=1)
    else:
        # Hidden states from the previous pipeline stage are local already (and, under sequence parallel,
        # split further over tp): the full length comes from the full-length inputs, else the configured one.
        first = kwargs.get("hidden_states")
        first = first if first is not None else kwargs["input_ids"]
        full = kwargs.get("position_ids") if kwargs.get("position_ids") is not None else kwargs.get("labels")
        seq_len = full.shape[-1] if full is not None else int(module.args.seq_length)
    idx = load_balanced_indices(seq_len, cp, rank, device=first.device)
    position_ids = kwargs.get("position_ids")  # [b, S], or mRoPE's [3, b, S]: the sequence is the last dim
    kwargs["position_ids"] = (idx.unsqueeze(0) if position_ids is None
                              else position_ids.index_select(position_ids.dim() - 1, idx))
    if kwargs.get("labels") is not None:
        kwargs["labels"] = kwargs["labels"].index_select(1, idx)
    mask = kwargs.get("attention_mask")
    if isinstance(mask, TwoSidedMask):  # image blocks: this rank's query rows, every key column
        full = mask.full_layers
        kwargs["attention_mask"] = TwoSidedMask(mask.mask.index_select(-2, idx), mask.sliding_only,
                                                None if full is None else full.index_select(-2, idx))
    elif mask is not None:
        kwargs["attention_mask"] = mask.index_select(-2, idx)
    return (), kwargs


def _gather_outputs(module: nn.Module, args: tuple, kwargs: dict, output: torch.Tensor) -> torch.Tensor:
    """Forward hook: per-token losses (or logits) of the last stage back to the full sequence."""
    if not getattr(module, "post_process", True):
        return output
    if isinstance(output, DTensor):
        output = output.full_tensor()
    return gather_sequence(output, getattr(module, CONTEXT_PARALLEL_ATTR), seq_dim=1)


def apply_context_parallel(model: nn.Module, group: Any) -> nn.Module:
    """Apply the context-parallel plan over ``group`` to ``model`` (a ``GPTModel``, possibly on meta).

    Replaces every ``SelfAttention.core_attention`` with ``ContextParallelAttention(group)``, gives MoE routers
    and multi-token prediction their view of the split sequence, and hooks the model so that it takes
    full-length inputs and returns full-length per-token losses (see the module docstring). Apply it after
    tensor parallel and before data parallel (DDP/FSDP2 over ``dp × cp``). Returns ``model``. A group of one
    rank (or None) leaves the model unchanged, and so does a second call with the same group.
    """
    if group is None or dist.get_world_size(group) == 1:
        return model
    root = _unwrap(model)
    if not hasattr(root, "decoder") and hasattr(getattr(root, "language_model", None), "decoder"):
        # a vision-language model: its language model takes the whole sequence's embeddings (images put in,
        # positions numbered on the whole sequence) as decoder_input and is split like any GPT model
        root = root.language_model
    applied = getattr(root, CONTEXT_PARALLEL_ATTR, None)
    if applied is group:  # idempotent: a second call over the same group changes nothing
        return model
    if applied is not None:
        raise NotSupportedError("the context-parallel plan is already applied to this model over another group")
    # self-attention (linear_q) and multi-latent attention (mla) layers
    attentions = [m for m in root.modules()
                  if hasattr(m, "core_attention") and (hasattr(m, "linear_q") or hasattr(m, "mla"))]
    mixers = apply_mamba_context_parallel(root, group)  # Mamba layers: an all-to-all to heads and back
    mixers += apply_gated_delta_net_context_parallel(root, group)  # gated DeltaNet layers: the same
    if not (attentions or mixers) or not hasattr(root, "decoder"):
        raise NotSupportedError(
            f"context_parallel_size={dist.get_world_size(group)}: the context-parallel plan needs longspan's "
            f"GPTModel or MambaModel (self-attention layers with a swappable core_attention, Mamba mixers), "
            f"not {type(root).__name__}"
        )
    core = ContextParallelAttention(group)
    for attention in attentions:
        attention.core_attention = core
    _install_sequence_shards(root, group)
    setattr(root, CONTEXT_PARALLEL_ATTR, group)
    root.register_forward_pre_hook(_slice_inputs, with_kwargs=True)
    root.register_forward_hook(_gather_outputs, with_kwargs=True)
    _log.debug("context parallel over %d ranks: %d attention layers", dist.get_world_size(group), len(attentions))
    return model
