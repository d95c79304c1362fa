"""The Mamba-2 state-space scan (SSD), in plain PyTorch: a chunked form for training, a sequential reference.

Per head ``h`` (``p`` channels, state size ``n``), with ``a_t = dt_t · A_h`` (``A_h < 0``)::

    S_t = exp(a_t) · S_{t-1} + dt_t · x_t ⊗ B_t        (state [p, n])
    y_t = S_t · C_t                                     (contract n)

``B`` and ``C`` are shared by the heads of a group (``heads // groups`` heads each). Shapes: ``x [b, l, h, p]``,
``dt [b, l, h]`` (already through softplus), ``A [h]``, ``B, C [b, l, g, n]``; the state is ``[b, h, p, n]``.

The chunked form (Mamba-2's "state space duality") cuts the sequence into chunks of ``chunk_size``: inside a
chunk the recurrence is a masked (causal, decaying) attention-like matrix product; between chunks only the
``[h, p, n]`` states are carried. Cost is linear in the sequence length. Sequences that do not divide by the
chunk are padded with ``dt = 0`` (no decay, no input), which leaves outputs and the final state unchanged.
The scans run in float32 (float64 for float64 inputs) whatever the input dtype, as the fused kernels do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def _heads_from_groups(t: torch.Tensor, heads: int) -> torch.Tensor:
    """``[..., g, n]`` -> ``[..., heads, n]``: head i reads group i // (heads // g) (Megatron and HF order)."""
    return t.repeat_interleave(heads // t.shape[-2], dim=-2)


def segment_sums(a: torch.Tensor) -> torch.Tensor:
    """``out[..., i, j] = a[j+1] + ... + a[i]`` for ``j <= i`` (0 on the diagonal), ``-inf`` above it.

    Summing the masked values directly (not differencing a cumulative sum) keeps ``exp(out)`` accurate when
    the cumulative decay is large.
    """
    q = a.shape[-1]
    rows = a[..., :, None].expand(*a.shape, q)  # rows[..., i, j] = a[i]
    strictly_lower = torch.ones(q, q, dtype=torch.bool, device=a.device).tril(-1)
    sums = rows.masked_fill(~strictly_lower, 0.0).cumsum(dim=-2)
    causal = torch.ones(q, q, dtype=torch.bool, device=a.device).tril()
    return sums.masked_fill(~causal, float("-inf"))


def ssd_chunked_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSD scan in chunks: returns ``y [b, l, h, p]`` (float32 or wider) and the final state ``[b, h, p, n]``."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    batch, length, heads, head_dim = x.shape
    dtype = _compute_dtype(x)
    x, dt, A, B, C = (t.to(dtype) for t in (x, dt, A, B, C))
    pad = (-length) % chunk_size
    if pad:
        x = F.pad(x, (0, 0, 0, 0, 0, pad))
        dt = F.pad(dt, (0, 0, 0, pad))
        B = F.pad(B, (0, 0, 0, 0, 0, pad))
        C = F.pad(C, (0, 0, 0, 0, 0, pad))
    chunks = (length + pad) // chunk_size
    q = chunk_size
    x = x.view(batch, chunks, q, heads, head_dim)
    dt = dt.view(batch, chunks, q, heads)
    B = _heads_from_groups(B.view(batch, chunks, q, *B.shape[-2:]), heads)  # [b, c, q, h, n]
    C = _heads_from_groups(C.view(batch, chunks, q, *C.shape[-2:]), heads)
    a = (dt * A).permute(0, 3, 1, 2)  # [b, h, c, q]
    a_cum = a.cumsum(dim=-1)
    decay = torch.exp(segment_sums(a))  # [b, h, c, q(i), q(j)]: decay from position j to i inside a chunk
    x_dt = x * dt[..., None]

    # 1. Inside each chunk: y_i = sum_{j <= i} (C_i · B_j) decay[i, j] dt_j x_j.
    y_diag = torch.einsum("bcihn,bcjhn,bhcij,bcjhp->bcihp", C, B, decay, x_dt)
    # 2. Each chunk's own contribution to the state at its end.
    to_end = decay[..., -1, :]  # [b, h, c, q]: decay from position j to the chunk's last position
    chunk_states = torch.einsum("bcjhn,bhcj,bcjhp->bchpn", B, to_end, x_dt)
    # 3. Carry the states across chunks (a short loop: one step per chunk).
    chunk_decay = torch.exp(a_cum[..., -1])  # [b, h, c]
    state = x.new_zeros(batch, heads, head_dim, B.shape[-1]) if initial_state is None else initial_state.to(dtype)
    starts = []
    for c in range(chunks):
        starts.append(state)
        state = chunk_decay[:, :, c, None, None] * state + chunk_states[:, c]
    start_states = torch.stack(starts, dim=1)  # [b, c, h, p, n]: the state entering each chunk
    # 4. The entering state's contribution to each position: y_i += decay(start -> i) · C_i · S.
    y_off = torch.einsum("bcihn,bchpn,bhci->bcihp", C, start_states, torch.exp(a_cum))
    y = (y_diag + y_off).reshape(batch, chunks * q, heads, head_dim)[:, :length]
    return y, state


def ssd_sequential_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence one position at a time (the reference, and the form used for generation)."""
    batch, length, heads, head_dim = x.shape
    dtype = _compute_dtype(x)
    x, dt, A = x.to(dtype), dt.to(dtype), A.to(dtype)
    B = _heads_from_groups(B.to(dtype), heads)
    C = _heads_from_groups(C.to(dtype), heads)
    state = x.new_zeros(batch, heads, head_dim, B.shape[-1]) if initial_state is None else initial_state.to(dtype)
    ys = []
    for t in range(length):
        state = ssd_step(state, x[:, t], dt[:, t], A, B[:, t], C[:, t])
        ys.append(torch.einsum("bhpn,bhn->bhp", state, C[:, t]))
    return torch.stack(ys, dim=1), state


def ssd_step(
    state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor
) -> torch.Tensor:
    """One step of the recurrence: ``state [b, h, p, n]``, ``x [b, h, p]``, ``dt [b, h]``, ``B, C [b, h, n]``
    (per head). Returns the new state (the output is ``einsum('bhpn,bhn->bhp', new_state, C)``)."""
    decay = torch.exp(dt * A)[..., None, None]
    return decay * state + (dt[..., None] * x)[..., None] * B[:, :, None, :]
