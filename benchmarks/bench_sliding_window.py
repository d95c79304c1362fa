"""Sliding-window attention cost per token: full causal attention against a window of 512, sequences 2k -> 16k.

Grouped-query attention alone (8 query heads, 4 kv groups, head dim 64, batch 1), forward and backward, through
longspan's attention core (``longspan.models.attention.core_attention``):

- ``full causal``: no mask, SDPA's ``is_causal`` path (what a full-attention layer runs);
- ``window W``: a ``WindowedMask(W)`` (what a sliding-window layer runs): on long sequences the block-local path
  of ``longspan.models.sliding_window`` cuts the queries into chunks of ``max(W, MIN_CHUNK)`` and attends each
  only to the keys its window reaches, so its time per token should stay flat while full attention's grows
  with the sequence.

Besides time per token, the table gives the keys each query attends to on average (the work per token the
kernels cannot avoid: ``(s + 1) / 2`` for causal, ``min(W, ...)`` for the window) and the largest
``[queries, keys]`` block one kernel call sees.

Run: ``python benchmarks/bench_sliding_window.py [--seqs 2048 4096 8192 16384] [--window 512] [--steps 3]
[--threads N]``. Medians of ``--steps`` timed steps after one warm-up step; prints a Markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import time

HEADS, GROUPS, HEAD_DIM = 8, 4, 64


def _step_times(seq: int, window: int | None, steps: int) -> list[float]:
    import torch

    from longspan.models.sliding_window import WindowedMask
    from longspan.models.attention import core_attention

    g = torch.Generator().manual_seed(seq)
    q = torch.randn(1, HEADS, seq, HEAD_DIM, generator=g).requires_grad_()
    k = torch.randn(1, GROUPS, seq, HEAD_DIM, generator=g).requires_grad_()
    v = torch.randn(1, GROUPS, seq, HEAD_DIM, generator=g).requires_grad_()
    grad = torch.randn(1, HEADS, seq, HEAD_DIM, generator=g)
    times = []
    for _ in range(steps + 1):  # the first step warms up
        mask = None if window is None else WindowedMask(window, None)  # a new forward: a new mask memo
        start = time.perf_counter()
        out = core_attention(q, k, v, mask, 0.0, None)
        out.backward(grad)
        times.append(time.perf_counter() - start)
        q.grad = k.grad = v.grad = None
    return times[1:]


def _keys_per_query(seq: int, window: int | None) -> float:
    if window is None:
        return (seq + 1) / 2
    return sum(min(i + 1, window) for i in range(seq)) / seq


def _largest_block(seq: int, window: int | None) -> str:
    from longspan.models import sliding_window as sw

    if window is None:
        return f"{seq}×{seq}"
    chunk = max(window, sw.MIN_CHUNK)
    if seq <= chunk or seq <= chunk + window - 1:
        return f"{seq}×{seq}"
    return f"{chunk}×{chunk + window - 1}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args(argv)

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"# attention fwd+bwd, {HEADS} heads / {GROUPS} kv groups, head dim {HEAD_DIM}, batch 1, fp32, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}; median of {args.steps} steps")
    print(f"| sequence | full causal (µs/token) | window {args.window} (µs/token) | speed-up | keys/query full | "
          f"keys/query window | largest block (window) |")
    print("|---|---|---|---|---|---|---|")
    for seq in args.seqs:
        full = statistics.median(_step_times(seq, None, args.steps)) / seq * 1e6
        windowed = statistics.median(_step_times(seq, args.window, args.steps)) / seq * 1e6
        print(f"| {seq} | {full:.1f} | {windowed:.1f} | {full / windowed:.2f}× | {_keys_per_query(seq, None):.0f} | "
              f"{_keys_per_query(seq, args.window):.0f} | {_largest_block(seq, args.window)} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
