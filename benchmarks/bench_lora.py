"""LoRA vs full finetuning: step time, trainable parameters and peak memory, one model and batch.

    PYTHONPATH=. python benchmarks/bench_lora.py [--layers 4] [--hidden 512] [--seq 512] [--mbs 4] [--steps 6]

Each mode runs in its own process (so its peak resident memory is its own), builds the same Llama-shaped GPT
the way the trainer does (meta model -> adapters -> per-parameter init), trains ``--steps`` AdamW steps on
random tokens with the trainer's per-token loss, and reports the median step time after one warm-up step,
the trainable parameter count, and the process's peak RSS. Modes: ``full`` (every parameter trains),
``lora`` (Megatron Bridge's defaults: rank 32 on linear_qkv/proj/fc1/fc2), ``dora``, ``canonical``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODES = ("full", "lora", "dora", "canonical")


def run_mode(mode: str, args: argparse.Namespace) -> dict:
    import torch
    import torch.nn.functional as F

    from longspan.models.gpt import build_gpt_model, init_weights
    from longspan.models.gpt_provider import GPTModelProvider
    from longspan.peft import CanonicalLoRA, DoRA, LoRA
    from longspan.peft.adapters import init_adapters

    torch.set_num_threads(args.threads)
    provider = GPTModelProvider(
        num_layers=args.layers, hidden_size=args.hidden, ffn_hidden_size=4 * args.hidden,
        num_attention_heads=args.hidden // 64, num_query_groups=max(1, args.hidden // 256), seq_length=args.seq,
        vocab_size=args.vocab, normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, position_embedding_type="rope", hidden_dropout=0.0, attention_dropout=0.0,
    )
    model = build_gpt_model(provider, materialize=False)
    peft = {"lora": LoRA(), "dora": DoRA(), "canonical": CanonicalLoRA()}.get(mode)
    if peft is not None:
        peft.apply(model)
    init_weights(model, seed=1234, device="cpu")
    if peft is not None:
        init_adapters([model], 1234)
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4, foreach=True)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab, (args.mbs, args.seq), generator=gen)
    labels = torch.randint(0, args.vocab, (args.mbs, args.seq), generator=gen)
    times = []
    for _ in range(args.steps + 1):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        model(tokens, labels=labels).mean().backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return {
        "mode": mode,
        "step_s": statistics.median(times[1:]),
        "trainable": sum(p.numel() for p in trainable),
        "total": sum(p.numel() for p in model.parameters()),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--mbs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # one mode, in a child process
    args = parser.parse_args()
    if args.mode:
        print(json.dumps(run_mode(args.mode, args)))
        return
    rows = []
    for mode in MODES:
        child = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--mode", mode], capture_output=True,
                               text=True, check=True)
        rows.append(json.loads(child.stdout.strip().splitlines()[-1]))
    full = rows[0]
    print(f"model: {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}; batch {args.mbs}x{args.seq}; "
          f"{args.threads} threads; median of {args.steps} steps")
    print(f"| mode | step (s) | vs full | trainable params | trainable % | peak RSS (MiB) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['step_s']:.3f} | {r['step_s'] / full['step_s']:.2f}x | {r['trainable']:,} | "
              f"{100 * r['trainable'] / r['total']:.2f}% | {r['peak_rss_mib']:.0f} |")


if __name__ == "__main__":
    main()
