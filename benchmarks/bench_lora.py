"""Full finetuning vs LoRA vs QLoRA: step time, trainable parameters and peak memory, one model and batch.

    PYTHONPATH=. python benchmarks/bench_lora.py                      # ~300M Llama-shaped model, full/lora/qlora
    PYTHONPATH=. python benchmarks/bench_lora.py --hidden-size 128 --layers 2 --seq 64 --vocab 512   # smoke

Each mode runs in its own process (so its peak memory is its own), builds the same Llama-shaped GPT the way the
trainer does (meta model -> adapters -> per-parameter init; QLoRA then stores the adapted layers' base weights
in NF4, as ``finetune`` does once the base is loaded), trains ``--steps`` AdamW steps on random tokens with the
trainer's per-token loss, and reports the median step time after one warm-up step, the trainable parameter
count and two peaks: at set-up (the base is materialized in ``--dtype`` before QLoRA quantizes it) and during
the training steps (the steady state finetuning pays). On CUDA the peaks are ``torch.cuda.max_memory_allocated``;
on a CPU the process's peak RSS (VmHWM, reset between set-up and the steps through /proc/self/clear_refs).
Modes: ``full`` (every parameter trains), ``lora`` (Megatron Bridge's defaults: rank 32 on
linear_qkv/proj/fc1/fc2), ``qlora`` (the same LoRA on an NF4 base), and ``dora``, ``canonical`` on request.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODES = ("full", "lora", "qlora", "dora", "canonical")
DEFAULT_MODES = ("full", "lora", "qlora")


def _cpu_peak_mib() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _reset_cpu_peak() -> None:
    # glibc keeps freed pages (the full-precision base QLoRA quantized away) in the process: hand them back
    # first, or the RSS peak of the steps would still count them.
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # resets VmHWM to the current RSS
    except OSError:
        pass


def run_mode(mode: str, args: argparse.Namespace) -> dict:
    import torch
    import torch.nn.functional as F

    from longspan.models.gpt import build_gpt_model, init_weights
    from longspan.models.gpt_provider import GPTModelProvider
    from longspan.peft import CanonicalLoRA, DoRA, LoRA
    from longspan.peft.adapters import init_adapters
    from longspan.peft.qlora import quantize_base_weights

    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda" if cuda else "cpu")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype or ("bf16" if cuda else "fp32")]
    torch.set_num_threads(args.threads)
    hidden = args.hidden_size
    provider = GPTModelProvider(
        num_layers=args.layers, hidden_size=hidden, ffn_hidden_size=4 * hidden,
        num_attention_heads=max(1, hidden // 64), num_query_groups=max(1, hidden // 256), seq_length=args.seq,
        vocab_size=args.vocab, normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, position_embedding_type="rope", hidden_dropout=0.0, attention_dropout=0.0,
    )
    model = build_gpt_model(provider, materialize=False)
    peft = {"lora": LoRA(), "qlora": LoRA(base_quantization="nf4"), "dora": DoRA(),
            "canonical": CanonicalLoRA()}.get(mode)
    if peft is not None:
        peft.apply(model)
    init_weights(model, seed=1234, device=device)
    if peft is not None:
        init_adapters([model], 1234)
    model = model.to(dtype)
    quantize_base_weights([model], peft)
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4, foreach=True)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab, (args.mbs, args.seq), generator=gen).to(device)
    labels = torch.randint(0, args.vocab, (args.mbs, args.seq), generator=gen).to(device)
    if cuda:
        torch.cuda.synchronize()
        setup_peak = torch.cuda.max_memory_allocated() / 2**20
        torch.cuda.reset_peak_memory_stats()
    else:
        setup_peak = _cpu_peak_mib()
        _reset_cpu_peak()
    times = []
    for _ in range(args.steps + 1):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        model(tokens, labels=labels).float().mean().backward()
        optimizer.step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    step_peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else _cpu_peak_mib()
    return {
        "mode": mode,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "dtype": str(dtype).replace("torch.", ""),
        "step_s": statistics.median(times[1:]),
        "trainable": sum(p.numel() for p in trainable),
        "total": sum(p.numel() for p in model.parameters())
        + sum(b.numel() * 2 for n, b in model.named_buffers() if n.endswith("nf4_packed")),
        "setup_peak_mib": setup_peak,
        "step_peak_mib": step_peak,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden-size", "--hidden", dest="hidden_size", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--mbs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default=None,
                        help="parameter and compute dtype (default: bf16 on CUDA, fp32 on a CPU)")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU even when CUDA is available")
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # one mode, in a child process
    args = parser.parse_args()
    if args.mode:
        print(json.dumps(run_mode(args.mode, args)))
        return
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"--modes: unknown {unknown}; valid: {', '.join(MODES)}")
    rows = []
    for mode in modes:
        child = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--mode", mode], capture_output=True,
                               text=True)
        if child.returncode != 0:
            sys.exit(f"mode {mode} failed:\n{child.stderr[-4000:]}")
        rows.append(json.loads(child.stdout.strip().splitlines()[-1]))
    first = rows[0]
    memory = "peak allocated" if first["device"] != "cpu" else "peak RSS"
    print(f"model: {first['total']:,} parameters ({args.layers} layers, hidden {args.hidden_size}, vocab "
          f"{args.vocab}); batch {args.mbs}x{args.seq}; {first['device']}, {first['dtype']}; "
          f"{args.threads} threads; median of {args.steps} steps")
    print(f"| mode | step (s) | vs {first['mode']} | trainable params | trainable % | set-up {memory} (MiB) "
          f"| training {memory} (MiB) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['step_s']:.3f} | {r['step_s'] / first['step_s']:.2f}x | {r['trainable']:,} | "
              f"{100 * r['trainable'] / r['total']:.2f}% | {r['setup_peak_mib']:.0f} | {r['step_peak_mib']:.0f} |")


if __name__ == "__main__":
    main()
