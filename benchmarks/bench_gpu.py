"""One-device training throughput and MFU: longspan (default, eager, compiled + float8) vs HF transformers
(eager, per-layer compiled) vs a plain PyTorch loop over the same model, kinds interleaved, medians.

Shape ``1b`` (the default on CUDA): a Llama-3.2-1B-like model, 16 layers, hidden 2048, FFN 8192, 32 heads /
8 query groups, vocabulary 128256, batch 4 x 2048 (``--seq 4096`` for the longer run), bf16 mixed precision
(fp32 master weights and optimizer state), AdamW. Shape ``tiny`` (the default without CUDA): 2 layers, hidden
64, vocabulary 512, batch 2 x 64, fp32 on the CPU, so the script runs end to end anywhere.

MFU counts 6·N + 12·L·h·s FLOPs per token (N parameters without embeddings, L layers, h hidden, s sequence)
against the device's peak (longspan.planner.peak_flops: table by device, measured on a CPU,
LONGSPAN_PEAK_TFLOPS overrides). Kinds that cannot run here (float8 without CUDA FP8 hardware or torchao,
compile without a compiler) are listed as skipped with the reason.

Run: ``python benchmarks/bench_gpu.py [--shape 1b|tiny] [--seq 2048] [--steps 10] [--warmup 3]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SHAPES = {
    "1b": dict(layers=16, hidden=2048, ffn=8192, heads=32, groups=8, vocab=128256, batch=4, seq=2048),
    "tiny": dict(layers=2, hidden=64, ffn=128, heads=4, groups=2, vocab=512, batch=2, seq=64),
}


def longspan_config(shape: dict, run_dir: str, cuda: bool, **overrides: Any) -> Any:
    from longspan.recipes import get_recipe

    cfg = get_recipe("tiny")
    m = cfg.model
    m.num_layers, m.hidden_size, m.ffn_hidden_size = shape["layers"], shape["hidden"], shape["ffn"]
    m.num_attention_heads, m.num_query_groups = shape["heads"], shape["groups"]
    m.seq_length, m.vocab_size, m.make_vocab_size_divisible_by = shape["seq"], shape["vocab"], 128
    m.hidden_dropout = m.attention_dropout = 0.0
    if cuda:  # bf16 mixed: bf16 compute, fp32 master weights and optimizer state
        from longspan.config.schema.optim import apply_mixed_precision, get_mixed_precision_config

        apply_mixed_precision(get_mixed_precision_config("bf16_mixed"), cfg.model, cfg.optimizer, cfg.ddp)
    cfg.tokenizer.tokenizer_type, cfg.tokenizer.tokenizer_model = "NullTokenizer", None
    cfg.tokenizer.vocab_size = shape["vocab"] - 1
    cfg.dataset.data_path, cfg.dataset.sequence_length = None, shape["seq"]
    cfg.train.micro_batch_size = cfg.train.global_batch_size = shape["batch"]
    cfg.train.train_iters, cfg.train.eval_interval = 10_000, None
    cfg.optimizer.weight_decay, cfg.optimizer.clip_grad = 0.1, 1.0
    cfg.checkpoint.save = cfg.checkpoint.load = None
    cfg.logger.tensorboard_dir = run_dir
    for key, value in overrides.items():
        section, field = key.split(".")
        setattr(getattr(cfg, section), field, value)
    return cfg


def longspan_kind(shape: dict, run_dir: str, cuda: bool, **overrides: Any) -> Callable[[], None]:
    from longspan.training.step.forward_step import forward_step
    from longspan.training.setup import setup
    from longspan.training.train import train_step
    from longspan.training.utils.train_utils import prepare_forward_step_func

    out = setup(longspan_config(shape, run_dir, cuda, **overrides))
    fwd = prepare_forward_step_func(forward_step, out.state)

    def step() -> None:
        train_step(fwd, out.train_data_iterator, out.model, out.optimizer, out.scheduler, out.state)
        out.state.train_state.step += 1

    return step


def plain_kind(shape: dict, run_dir: str, cuda: bool) -> Callable[[], None]:
    """The longspan model in a hand-written loop: autocast, loss, backward, clip, AdamW (fused on CUDA)."""
    cfg = longspan_config(shape, run_dir, cuda)
    cfg.model.vocab_size = shape["vocab"]
    cfg.model.params_dtype = torch.float32  # fp32 master weights; autocast computes in bf16
    cfg.model.finalize()
    device = torch.device("cuda" if cuda else "cpu")
    model = cfg.model.provide().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, **({"fused": True} if cuda else {}))
    tokens = torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"]), device=device)

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = model(tokens, labels=tokens).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    return step


def hf_kind(shape: dict, cuda: bool, compiled: bool) -> Callable[[], None]:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["ffn"],
        num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"], num_key_value_heads=shape["groups"],
        max_position_embeddings=shape["seq"], rms_norm_eps=1e-5, tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    device = torch.device("cuda" if cuda else "cpu")
    model = LlamaForCausalLM(config).to(device)
    if compiled:
        for layer in model.model.layers:
            layer.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, **({"fused": True} if cuda else {}))
    tokens = torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"]), device=device)

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = model(input_ids=tokens, labels=tokens).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    return step


def float8_unavailable(cuda: bool) -> str | None:
    if not cuda:
        return "needs CUDA"
    if torch.cuda.get_device_capability() < (8, 9):
        return "needs FP8 hardware (compute capability >= 8.9)"
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        return "needs torchao (pip install torchao)"
    return None


def flops_per_token(shape: dict) -> float:
    h, L, f, V = shape["hidden"], shape["layers"], shape["ffn"], shape["vocab"]
    kv = h // shape["heads"] * shape["groups"]
    non_embedding = L * (2 * h * h + 2 * h * kv + 3 * h * f + 2 * h) + h * V  # + the output layer
    return 6.0 * non_embedding + 12.0 * L * h * shape["seq"]


def main() -> None:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b" if cuda else "tiny")
    parser.add_argument("--seq", type=int, default=None, help="sequence length (default: the shape's)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--kinds", nargs="*", default=None, help="subset of kinds to run")
    args = parser.parse_args()
    shape = dict(SHAPES[args.shape])
    if args.seq:
        shape["seq"] = args.seq
    from longspan.planner.peak_flops import peak_flops_per_device

    device = torch.device("cuda" if cuda else "cpu")
    peak = peak_flops_per_device(device)
    runs: dict[str, Callable[[], None]] = {}
    skipped: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        builders: dict[str, Callable[[], Callable[[], None]]] = {
            "longspan": lambda: longspan_kind(shape, f"{tmp}/a", cuda),
            "ls-eager": lambda: longspan_kind(shape, f"{tmp}/b", cuda, **{"train.torch_compile": False}),
            "ls-fused-loss": lambda: longspan_kind(shape, f"{tmp}/c", cuda, **{"model.cross_entropy_loss_fusion": True}),
            "plain": lambda: plain_kind(shape, f"{tmp}/d", cuda),
            "hf-eager": lambda: hf_kind(shape, cuda, compiled=False),
            "hf-compiled": lambda: hf_kind(shape, cuda, compiled=True),
        }
        reason = float8_unavailable(cuda)
        if reason:
            skipped["ls-float8"] = reason
        else:
            builders["ls-float8"] = lambda: longspan_kind(shape, f"{tmp}/e", cuda, **{"model.fp8": "hybrid"})
        for name, build in builders.items():
            if args.kinds and name not in args.kinds:
                continue
            try:
                runs[name] = build()
            except Exception as exc:  # a kind this machine cannot run is reported, the others still run
                skipped[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        times: dict[str, list[float]] = {name: [] for name in runs}
        names = list(runs)
        for step in range(args.warmup + args.steps):
            k = step % max(1, len(names))
            for name in names[k:] + names[:k]:
                if cuda:
                    torch.cuda.synchronize()
                start = time.perf_counter()
                runs[name]()
                if cuda:
                    torch.cuda.synchronize()
                if step >= args.warmup:
                    times[name].append(time.perf_counter() - start)
    tokens = shape["batch"] * shape["seq"]
    fpt = flops_per_token(shape)
    where = torch.cuda.get_device_name() if cuda else f"CPU, {torch.get_num_threads()} threads"
    print(f"\nshape {args.shape}: {shape}; {args.steps} interleaved steps on {where}; torch {torch.__version__}; "
          f"peak {peak / 1e12 if peak else float('nan'):.3g} TFLOP/s")
    print(f"{'kind':14s} {'median s/step':>14s} {'tokens/s':>10s} {'MFU':>7s}")
    for name in names:
        med = statistics.median(times[name])
        mfu = tokens * fpt / med / peak if peak else float("nan")
        print(f"{name:14s} {med:14.4f} {tokens / med:10.0f} {100 * mfu:6.1f}%")
    for name, why in skipped.items():
        print(f"{name:14s} skipped: {why}")


if __name__ == "__main__":
    main()
