"""The gated delta rule (Yang, Kautz & Hatamizadeh, "Gated Delta Networks", 2024): the recurrence of a gated
DeltaNet layer (``longspan.models.gated_delta_net``), in plain PyTorch, computed in float32.

Per value head, a state ``S`` of shape ``[dk, dv]`` is decayed and then corrected towards the new value::

    S'  = exp(g_t) · S_{t-1}
    S_t = S' + β_t · k_t (v_t - S'^T k_t)^T          (the delta rule: write only what S' mispredicts)
    o_t = S_t^T (scale · q_t)

Two forms compute the same numbers:

- ``recurrent_gated_delta_rule``: the loop above, one token at a time (decoding; the reference).
- ``chunk_gated_delta_rule``: chunks of ``chunk_size`` tokens (training). Inside a chunk the corrections ``u_j``
  of all tokens solve one unit lower-triangular system (the UT transform of the WY representation): with
  ``Γ`` the cumulative log-decay inside the chunk and ``S_0`` the state entering it,

      (I + A) U = β·V - β·e^Γ·K S_0,      A_jm = β_j e^(Γ_j-Γ_m) (k_j·k_m)   for m < j,

  after which the chunk's outputs ``O = (e^Γ·Q) S_0 + (Q K^T ⊙ e^(Γ_i-Γ_j), j ≤ i) U`` and the state leaving it
  ``S_C = e^(Γ_C) S_0 + (e^(Γ_C-Γ)·K)^T U`` are matrix products; only the chunk-to-chunk state is sequential.

Inputs are ``q, k [b, s, key_heads, dk]``, ``v [b, s, value_heads, dv]``, ``g`` (log decay, ≤ 0) and ``beta``
``[b, s, value_heads]``. Grouped heads: value head ``h`` reads key head ``h // (value_heads / key_heads)``.
``q`` and ``k`` are used as given (the layer L2-normalises them); ``scale`` defaults to ``dk ** -0.5``.

On CUDA, ``chunked_gated_delta_rule`` runs flash-linear-attention's Triton kernel when that optional extra
(``pip install flash-linear-attention``) is installed (the same maths, equal within bf16 tolerance); everywhere
else, and without it, the plain PyTorch chunked form.

Packed sequences: ``cu_seqlens`` (``[n + 1]`` or ``[b, n + 1]``: each document's first position, then the end;
repeated values allowed, as the packing collates pad them) restarts the state at every document. The documents are
gathered into rows of their own (``DocumentLayout``), run from a zero state, and scattered back, so each
document's outputs and gradients are those of running it alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def _grouped(q: torch.Tensor, k: torch.Tensor, value_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``q``/``k`` repeated so that every value head has its key head (consecutive value heads share one)."""
    rep = value_heads // k.shape[2]
    if rep == 1:
        return q, k
    return q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)


def _heads_first(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """``[b, s, h, ...]`` -> float32 ``[b, h, s, ...]``."""
    return [t.transpose(1, 2).float() for t in tensors]


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule one token at a time. Returns the outputs ``[b, s, value_heads, dv]`` (in ``v``'s
    dtype) and, with ``output_final_state``, the float32 state ``[b, value_heads, dk, dv]`` after the last token.
    ``initial_state`` is the state before the first token (zeros when None)."""
    if cu_seqlens is not None:
        return _per_document(recurrent_gated_delta_rule, q, k, v, g, beta, scale, initial_state, output_final_state,
                             cu_seqlens)
    q, k = _grouped(q, k, v.shape[2])
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qh, kh, vh = _heads_first(q, k, v)
    gh, bh = _heads_first(g, beta)
    b, h, s, dk = kh.shape
    state = qh.new_zeros(b, h, dk, vh.shape[-1]) if initial_state is None else initial_state.float()
    outputs = []
    for t in range(s):
        state = state * gh[:, :, t].exp()[..., None, None]
        k_t = kh[:, :, t]
        predicted = torch.einsum("bhkv,bhk->bhv", state, k_t)
        correction = (vh[:, :, t] - predicted) * bh[:, :, t, None]
        state = state + k_t[..., :, None] * correction[..., None, :]
        outputs.append(torch.einsum("bhkv,bhk->bhv", state, qh[:, :, t] * scale))
    out = torch.stack(outputs, dim=2) if outputs else vh.new_zeros(b, h, 0, vh.shape[-1])
    return out.transpose(1, 2).to(v.dtype), (state if output_final_state else None)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    chunk_size: int = 64,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule in chunks of ``chunk_size`` tokens (the WY / UT-transform form); same arguments and
    results as ``recurrent_gated_delta_rule``, equal to it up to float32 rounding."""
    if cu_seqlens is not None:
        return _per_document(chunk_gated_delta_rule, q, k, v, g, beta, scale, initial_state, output_final_state,
                             cu_seqlens, chunk_size=chunk_size)
    q, k = _grouped(q, k, v.shape[2])
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qh, kh, vh = _heads_first(q, k, v)
    gh, bh = _heads_first(g, beta)
    b, h, s, dk = kh.shape
    dv = vh.shape[-1]
    pad = (-s) % chunk_size
    # zero padding at the end: g = 0, beta = 0 and k = 0 leave the state as it is, and no real token reads it
    qh, kh, vh = (F.pad(t, (0, 0, 0, pad)) for t in (qh, kh, vh))
    gh, bh = (F.pad(t, (0, pad)) for t in (gh, bh))
    n = (s + pad) // chunk_size
    qc, kc, vc = (t.reshape(b, h, n, chunk_size, -1) for t in (qh * scale, kh, vh))
    gc, bc = (t.reshape(b, h, n, chunk_size) for t in (gh, bh))
    gamma = gc.cumsum(-1)  # log of the decay from the chunk's start to each position
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    # e^(Γ_i - Γ_j) for j <= i; the masked entries (j > i) would overflow, so they are set before the exp
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    eye = torch.eye(chunk_size, dtype=qh.dtype, device=q.device)
    system = eye + (bc[..., None] * (kc @ kc.transpose(-1, -2)) * decay).tril(-1)  # I + A
    u_free = torch.linalg.solve_triangular(system, bc[..., None] * vc, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, (bc * gamma.exp())[..., None] * kc, upper=False, unitriangular=True)
    scores = (qc @ kc.transpose(-1, -2)) * decay  # within-chunk reads, j <= i
    q_decayed = qc * gamma.exp()[..., None]
    k_to_end = kc * (gamma[..., -1:] - gamma).exp()[..., None]
    chunk_decay = gamma[..., -1].exp()[..., None, None]
    state = qh.new_zeros(b, h, dk, dv) if initial_state is None else initial_state.float()
    outputs = []
    # unbound once, not indexed per chunk: the backward of an index is a zero tensor of the whole size per
    # chunk (quadratic in the length), that of unbind one stack of the chunks' gradients
    chunks = zip(*(t.unbind(2) for t in (u_free, w, q_decayed, scores, k_to_end, chunk_decay)))
    for u_free_i, w_i, q_i, scores_i, k_i, decay_i in chunks:
        u = u_free_i - w_i @ state
        outputs.append(q_i @ state + scores_i @ u)
        state = state * decay_i + k_i.transpose(-1, -2) @ u
    out = torch.cat(outputs, dim=2)[:, :, :s] if outputs else vh.new_zeros(b, h, 0, dv)
    return out.transpose(1, 2).to(v.dtype), (state if output_final_state else None)


def flash_linear_attention_rule():
    """flash-linear-attention's chunked gated delta rule kernel, or None when the optional extra is not
    installed."""
    try:  # function-level: an optional extra, imported only when a CUDA forward asks for it
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk_gated_delta_rule
    except ImportError:
        return None
    return fla_chunk_gated_delta_rule


def chunked_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``chunk_gated_delta_rule``, by flash-linear-attention's kernel on CUDA when it is installed (its chunk
    size is its own; ``q``/``k`` in ``v``'s dtype, the state in float32), else the plain PyTorch form."""
    kernel = flash_linear_attention_rule() if v.is_cuda else None
    if kernel is None:
        return chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk_size, initial_state=initial_state,
                                      output_final_state=output_final_state)
    q, k = _grouped(q.to(v.dtype), k.to(v.dtype), v.shape[2])  # one key head per value head: no grouping question
    state = None if initial_state is None else initial_state.float()
    out, final = kernel(q, k, v, g.float(), beta.to(v.dtype), scale=q.shape[-1] ** -0.5, initial_state=state,
                        output_final_state=output_final_state)
    return out.to(v.dtype), (final.float() if final is not None else None)


@dataclass
class DocumentLayout:
    """Where each packed document's tokens are: ``index [docs, longest]`` holds each document's flat positions in
    ``[b * s]`` (padding entries point at position 0 and are masked by ``valid``), and ``inverse [b * s]`` each
    flat position's place in ``[docs * longest]``. ``split``/``merge`` gather between the two layouts (both
    differentiable), so per-document code runs on ``[docs, longest, ...]`` rows that each start at their
    document's first token."""

    index: torch.Tensor
    valid: torch.Tensor
    inverse: torch.Tensor
    batch: int

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: torch.Tensor, batch: int, seq_len: int) -> "DocumentLayout":
        """The layout of ``batch`` rows of ``seq_len`` tokens whose documents start at ``cu_seqlens`` (``[n + 1]``
        for every row, or ``[b, n + 1]``: starts then the end; empty documents are skipped). Positions after a
        row's last boundary form one more document, so every token belongs to exactly one."""
        bounds = cu_seqlens.to(torch.long).cpu()
        bounds = bounds.expand(batch, -1) if bounds.dim() == 1 else bounds
        starts, lengths = [], []
        for row in range(batch):
            cuts = sorted({0, seq_len, *(min(max(int(x), 0), seq_len) for x in bounds[row])})
            for lo, hi in zip(cuts[:-1], cuts[1:]):
                starts.append(row * seq_len + lo)
                lengths.append(hi - lo)
        start = torch.tensor(starts)
        length = torch.tensor(lengths)
        longest = int(length.max())
        offsets = torch.arange(longest)
        valid = offsets[None, :] < length[:, None]
        index = torch.where(valid, start[:, None] + offsets[None, :], 0)
        inverse = torch.empty(batch * seq_len, dtype=torch.long)
        places = torch.arange(index.numel()).view_as(index)
        inverse[index[valid]] = places[valid]
        device = cu_seqlens.device
        return cls(index.to(device), valid.to(device), inverse.to(device), batch)

    def split(self, x: torch.Tensor) -> torch.Tensor:
        """``[b, s, ...]`` -> ``[docs, longest, ...]``, zeros after each document's end."""
        flat = x.reshape(-1, *x.shape[2:])
        rows = flat[self.index.reshape(-1)].view(*self.index.shape, *x.shape[2:])
        mask = self.valid.view(*self.valid.shape, *([1] * (x.dim() - 2)))
        return rows * mask.to(rows.dtype)

    def merge(self, rows: torch.Tensor) -> torch.Tensor:
        """``[docs, longest, ...]`` -> ``[b, s, ...]`` (the inverse of ``split``)."""
        flat = rows.reshape(-1, *rows.shape[2:])[self.inverse]
        return flat.view(self.batch, -1, *rows.shape[2:])


def _per_document(rule, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, **kwargs):
    """Run ``rule`` on each packed document on its own (a zero state at each start)."""
    if initial_state is not None or output_final_state:
        raise ValueError("the gated delta rule over packed documents (cu_seqlens) starts each from a zero state "
                         "and returns no final state")
    layout = DocumentLayout.from_cu_seqlens(cu_seqlens, v.shape[0], v.shape[1])
    out, _ = rule(*(layout.split(t) for t in (q, k, v, g, beta)), scale=scale, **kwargs)
    return layout.merge(out), None


__all__ = ["DocumentLayout", "chunk_gated_delta_rule", "chunked_gated_delta_rule", "flash_linear_attention_rule",
           "recurrent_gated_delta_rule"]
