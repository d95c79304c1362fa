"""Long-sequence benchmark for context parallel: time per forward+backward step, cp = 1 vs cp = 2.

Two levels, each at several sequence lengths (batch 1):

- ``attention``: causal grouped-query attention alone (8 query heads, 4 kv groups, head dim 64), forward and
  backward. cp = 1 is ``core_attention`` (SDPA, ``is_causal``) on the whole sequence; cp = 2 is
  ``context_parallel_attention`` on each rank's two load-balanced chunks (all-gather of K/V, reduce-scatter of
  their gradients), timed on every rank, the slowest rank reported.
- ``model``: a GPT (2 layers, hidden 256, 8 heads / 4 groups, SwiGLU 1024, vocab 4096), the per-token loss
  over the whole sequence, forward and backward; cp = 2 applies ``apply_context_parallel`` (the trainer's
  plan: full-length inputs in, full-length per-token losses out).

On CPU the ranks are processes on gloo. cp = 1 runs twice: with one thread (the same compute per process as
each cp = 2 rank) and with as many threads as cp = 2 has processes (the same cores in total). Besides time,
each process's peak resident memory growth over the run is reported: with cp = 2 each rank holds half the
activations. On a machine with ≥ 2 CUDA devices, ``--device cuda`` runs the ranks on NCCL instead.

Run: ``python benchmarks/bench_context_parallel.py [--level attention|model|both] [--seqs 2048 4096 8192]
[--steps 3] [--device cpu|cuda]``. Medians of ``--steps`` timed steps after one warm-up step.
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import statistics
import sys
import time
from typing import Any

HEADS, GROUPS, HEAD_DIM = 8, 4, 64


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _attention_steps(seq: int, steps: int, device: Any, group: Any) -> list[float]:
    import torch
    import torch.distributed as dist

    from longspan.models.attention import core_attention
    from longspan.parallel.context_parallel import context_parallel_attention, split_for_context_parallel

    torch.manual_seed(0)
    cp = dist.get_world_size(group) if group is not None else 1
    rank = dist.get_rank(group) if group is not None else 0
    q = torch.randn(1, HEADS, seq, HEAD_DIM, device=device)
    k = torch.randn(1, GROUPS, seq, HEAD_DIM, device=device)
    v = torch.randn(1, GROUPS, seq, HEAD_DIM, device=device)
    q, k, v = (split_for_context_parallel(t, cp, rank, seq_dim=2).requires_grad_(True) for t in (q, k, v))
    times = []
    for step in range(steps + 1):
        if group is not None:
            dist.barrier(group)
        _sync(device)
        start = time.perf_counter()
        if group is None:
            out = core_attention(q, k, v, None, 0.0, None)
        else:
            out = context_parallel_attention(q, k, v, None, 0.0, None, group)
        out.sum().backward()
        _sync(device)
        if step:  # the first step warms up
            times.append(time.perf_counter() - start)
        q.grad = k.grad = v.grad = None
    return times


def _model_steps(seq: int, steps: int, device: Any, group: Any) -> list[float]:
    import torch
    import torch.distributed as dist

    from longspan.models.gpt import build_gpt_model
    from longspan.models.init import init_weights
    from longspan.parallel.context_parallel import apply_context_parallel
    from longspan.recipes.tiny import tiny

    provider = tiny().model
    provider.num_layers, provider.hidden_size, provider.ffn_hidden_size = 2, 256, 1024
    provider.num_attention_heads, provider.num_query_groups = HEADS, GROUPS
    provider.seq_length, provider.vocab_size = seq, 4096
    provider.finalize()
    model = build_gpt_model(provider, materialize=False)
    if group is not None:
        apply_context_parallel(model, group)
    init_weights(model, seed=1, device=device)
    torch.manual_seed(0)
    tokens = torch.randint(0, 4096, (1, seq), device=device)
    labels = torch.randint(0, 4096, (1, seq), device=device)
    times = []
    for step in range(steps + 1):
        if group is not None:
            dist.barrier(group)
        _sync(device)
        start = time.perf_counter()
        loss = model(tokens, labels=labels).mean()
        loss.backward()
        _sync(device)
        if step:
            times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    return times


def _worker(rank: int, world: int, port: int, threads: int, level: str, seqs: list[int], steps: int,
            device_name: str, queue: Any) -> None:
    import torch

    torch.set_num_threads(threads)
    group = None
    device = torch.device(device_name)
    if world > 1:
        import torch.distributed as dist

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        if device.type == "cuda":
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world)
        group = dist.group.WORLD
    # Import everything first: RSS growth should measure tensors, not modules.
    import torch.nn.attention.bias  # noqa: F401

    import longspan.models.gpt  # noqa: F401
    import longspan.parallel.context_parallel  # noqa: F401
    import longspan.recipes.tiny  # noqa: F401

    rss_start = _rss_mb()
    results = []
    run = _attention_steps if level == "attention" else _model_steps
    for seq in seqs:
        times = run(seq, steps, device, group)
        results.append((seq, statistics.median(times), _rss_mb() - rss_start))
    queue.put((rank, results))
    if group is not None:
        import torch.distributed as dist

        dist.destroy_process_group()


def run_layout(world: int, threads: int, level: str, seqs: list[int], steps: int, device: str) -> dict[int, tuple]:
    """{seq: (median seconds of the slowest rank, peak RSS growth in MB of the largest rank)} for one layout."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, threads, level, seqs, steps, device, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    per_rank = dict(queue.get(timeout=3600) for _ in procs)
    for p in procs:
        p.join()
    out = {}
    for i, seq in enumerate(seqs):
        out[seq] = (max(per_rank[r][i][1] for r in per_rank), max(per_rank[r][i][2] for r in per_rank))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--level", choices=["attention", "model", "both"], default="both")
    parser.add_argument("--seqs", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args(argv)
    if args.device == "cuda":
        import torch

        if torch.cuda.device_count() < 2:
            print("--device cuda needs at least 2 CUDA devices (one per cp rank)", file=sys.stderr)
            return 2
    levels = ["attention", "model"] if args.level == "both" else [args.level]
    layouts = [("cp=1, 1 thread", 1, 1), ("cp=1, 2 threads", 1, 2), ("cp=2, 1 thread/rank", 2, 1)]
    if args.device == "cuda":
        layouts = [("cp=1", 1, 1), ("cp=2", 2, 1)]
    for level in levels:
        results = {name: run_layout(world, threads, level, args.seqs, args.steps, args.device)
                   for name, world, threads in layouts}
        print(f"\n{level}: forward+backward, median of {args.steps} steps (s) | peak RSS growth per process (MB)")
        print(f"{'seq':>7} | " + " | ".join(f"{name:>26}" for name, _, _ in layouts))
        for seq in args.seqs:
            cells = [f"{results[name][seq][0]:9.3f} s {results[name][seq][1]:8.0f} MB" for name, _, _ in layouts]
            print(f"{seq:>7} | " + " | ".join(f"{c:>26}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
