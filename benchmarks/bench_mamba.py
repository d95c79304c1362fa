"""Mamba-2 layer vs attention layer: time per forward(+backward) at sequence lengths 1k-16k.

    PYTHONPATH=. python benchmarks/bench_mamba.py [--lengths 1024 2048 4096 8192 16384] [--hidden 256]
        [--repeats 3] [--backward] [--device cpu|cuda]

One layer each, batch 1, fp32 (bf16 on a GPU), hidden ``--hidden``:

- Mamba: longspan's ``MambaLayer`` (norm, in_proj, causal conv, chunked SSD scan with chunk 128, gated norm,
  out_proj), d_inner = 2·hidden in heads of 64, state 64, 1 group;
- attention: the hybrid stack's ``AttentionLayer`` (norm, q/k/v, causal SDPA, out projection), heads of 64.

Reported: median milliseconds over ``--repeats`` runs after one warm-up, and the growth from the previous
length (x2 length: ~x2 means linear, ~x4 quadratic). The SSD scan is linear in the length (the chunk is
fixed), attention's score matrix is quadratic, so attention overtakes Mamba as sequences grow.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from longspan.models.mamba import AttentionLayer, MambaLayer, resolve_mamba_args  # noqa: E402
from longspan.models.mamba_provider import MambaProvider  # noqa: E402


def layers(hidden: int, dtype: torch.dtype, device: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    provider = MambaProvider(
        num_layers=2, hidden_size=hidden, num_attention_heads=hidden // 64, mamba_head_dim=64, mamba_state_dim=64,
        mamba_num_groups=1, mamba_chunk_size=128, hybrid_override_pattern="M*", vocab_size=128,
        ffn_hidden_size=4 * hidden, params_dtype=dtype,
    )
    args = resolve_mamba_args(provider)
    mamba, attention = MambaLayer(args, 0), AttentionLayer(args, 1)
    for module in (mamba, attention):
        for p in module.parameters():  # a sane scale everywhere (the benchmark times, it does not train)
            torch.nn.init.normal_(p, std=0.02)
        with torch.no_grad():
            if isinstance(module, MambaLayer):
                module.mixer.A_log.fill_(0.0)
    return mamba.to(device), attention.to(device)


def time_layer(layer: torch.nn.Module, x: torch.Tensor, repeats: int, backward: bool) -> float:
    def run() -> None:
        if backward:
            inp = x.detach().requires_grad_()
            layer(inp).sum().backward()
        else:
            with torch.no_grad():
                layer(x)
        if x.is_cuda:
            torch.cuda.synchronize()

    run()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) * 1000.0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--backward", action="store_true", help="time forward + backward (default: forward)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    torch.manual_seed(0)
    mamba, attention = layers(args.hidden, dtype, args.device)
    what = "forward+backward" if args.backward else "forward"
    print(f"# {what}, batch 1, hidden {args.hidden}, {dtype}, {args.device}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print(f"{'seq':>7} | {'mamba ms':>9} {'growth':>6} | {'attention ms':>12} {'growth':>6} | attention/mamba")
    previous = None
    for length in args.lengths:
        x = torch.randn(1, length, args.hidden, dtype=dtype, device=args.device)
        t_mamba = time_layer(mamba, x, args.repeats, args.backward)
        t_attn = time_layer(attention, x, args.repeats, args.backward)
        grow_m = f"x{t_mamba / previous[0]:.1f}" if previous else ""
        grow_a = f"x{t_attn / previous[1]:.1f}" if previous else ""
        print(f"{length:>7} | {t_mamba:>9.1f} {grow_m:>6} | {t_attn:>12.1f} {grow_a:>6} | {t_attn / t_mamba:.2f}")
        previous = (t_mamba, t_attn)


if __name__ == "__main__":
    main()
