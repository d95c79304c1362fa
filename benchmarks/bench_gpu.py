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

MoE case (``--moe``): a Qwen3-30B-A3B-shaped slice (``qwen3-30b-a3b``, the default on CUDA: 4 of its 48 layers
at its real widths, hidden 2048, 32 heads / 4 query groups of head dim 128, QK-norm, every layer MoE with 128
SwiGLU experts of width 768 routed top-8 (softmax over the chosen, HF's ``norm_topk_prob``), vocabulary 151936,
batch 4 x 2048, bf16) or ``moe-tiny`` (the default without CUDA: 2 layers, hidden 64, 8 experts top-2, fp32 on
the CPU). Kinds: ``ls-moe`` (the trainer's step on the ``tiny-moe`` recipe's MoE settings at that shape, grouped
expert GEMMs, bf16 mixed: bf16 weights, fp32 main weights and optimizer state), ``ls-moe-eager``
(``train.torch_compile=False``), ``ls-moe-seq`` (``moe_grouped_gemm=False``: the expert-by-expert loop) and
``hf-moe`` (transformers' ``Qwen3MoeForCausalLM`` with ``experts_implementation="grouped_mm"``, SDPA attention,
bf16 weights, ``AdamW(fused=True)`` on them, no fp32 main copy: a cheaper optimizer step than longspan's).
The kinds run one after another, each freed before the next (the slice's model and optimizer states of all
kinds do not fit on one device together); MFU counts the model FLOPs of ``longspan.planner.flops`` (experts at
top-k). ``--dry-run`` builds every kind at ``moe-tiny`` on the CPU and times one step of each: the check that
the script still runs, on machines without a GPU.

Run: ``python benchmarks/bench_gpu.py [--shape 1b|tiny] [--seq 2048] [--steps 10] [--warmup 3]``;
``python benchmarks/bench_gpu.py --moe [--shape qwen3-30b-a3b|moe-tiny] [--kinds ls-moe hf-moe] [--dry-run]``.
"""

from __future__ import annotations

import argparse
import gc
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
MOE_SHAPES = {
    "qwen3-30b-a3b": dict(layers=4, hidden=2048, heads=32, groups=4, head_dim=128, experts=128, topk=8,
                          expert_ffn=768, vocab=151936, batch=4, seq=2048),
    "moe-tiny": dict(layers=2, hidden=64, heads=4, groups=2, head_dim=16, experts=8, topk=2, expert_ffn=32,
                     vocab=512, batch=2, seq=64),
}


def longspan_config(shape: dict, run_dir: str, cuda: bool, **overrides: Any) -> Any:
    """The ``tiny`` recipe at a dense shape, or the ``tiny-moe`` recipe at an MoE shape (one with ``experts``)."""
    from longspan.recipes import get_recipe

    cfg = get_recipe("tiny-moe" if "experts" in shape else "tiny")
    m = cfg.model
    m.num_layers, m.hidden_size = shape["layers"], shape["hidden"]
    m.num_attention_heads, m.num_query_groups = shape["heads"], shape["groups"]
    if "experts" in shape:  # every layer MoE (the recipe's moe_layer_freq), grouped expert GEMMs
        m.kv_channels, m.qk_layernorm, m.ffn_hidden_size = shape["head_dim"], True, 4 * shape["hidden"]
        m.num_moe_experts, m.moe_router_topk = shape["experts"], shape["topk"]
        m.moe_ffn_hidden_size = shape["expert_ffn"]
    else:
        m.ffn_hidden_size = shape["ffn"]
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


def hf_moe_kind(shape: dict, cuda: bool) -> Callable[[], None]:
    """Qwen3MoeForCausalLM at an MoE shape with grouped_mm experts: bf16 weights on CUDA, fp32 on a CPU."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=4 * shape["hidden"],
        num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
        num_key_value_heads=shape["groups"], head_dim=shape["head_dim"], max_position_embeddings=shape["seq"],
        rms_norm_eps=1e-5, tie_word_embeddings=False, num_experts=shape["experts"],
        num_experts_per_tok=shape["topk"], moe_intermediate_size=shape["expert_ffn"], norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], attn_implementation="sdpa",
    )
    device = torch.device("cuda" if cuda else "cpu")
    with device:  # built where it runs: the slice's weights take minutes to initialise on a CPU
        model = Qwen3MoeForCausalLM._from_config(config, experts_implementation="grouped_mm",
                                                 dtype=torch.bfloat16 if cuda else torch.float32)
    if model.config._experts_implementation != "grouped_mm":
        raise RuntimeError(f"HF experts run {model.config._experts_implementation!r}, not grouped_mm")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=True)
    tokens = torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"]), device=device)

    def step() -> None:
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


MOE_KINDS = ("ls-moe", "ls-moe-eager", "ls-moe-seq", "hf-moe")


def moe_builders(shape: dict, tmp: str, cuda: bool) -> dict[str, Callable[[], Callable[[], None]]]:
    return {
        "ls-moe": lambda: longspan_kind(shape, f"{tmp}/a", cuda),
        "ls-moe-eager": lambda: longspan_kind(shape, f"{tmp}/b", cuda, **{"train.torch_compile": False}),
        "ls-moe-seq": lambda: longspan_kind(shape, f"{tmp}/c", cuda, **{"train.torch_compile": False,
                                                                         "model.moe_grouped_gemm": False}),
        "hf-moe": lambda: hf_moe_kind(shape, cuda),
    }


def time_kind(step: Callable[[], None], steps: int, warmup: int, cuda: bool) -> list[float]:
    """Seconds of each of ``steps`` steps after ``warmup`` untimed ones."""
    times = []
    for i in range(warmup + steps):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def run_moe(args: argparse.Namespace, shape: dict, cuda: bool, peak: float | None) -> None:
    """The MoE case: each kind built, timed and freed in turn; a table of medians, MFU and peak memory."""
    from longspan.planner.flops import num_floating_point_operations

    names = list(args.kinds or MOE_KINDS)
    unknown = sorted(set(names) - set(MOE_KINDS))
    if unknown:
        raise SystemExit(f"--kinds: {unknown} are not MoE kinds ({', '.join(MOE_KINDS)})")
    results: dict[str, tuple[float, float]] = {}
    skipped: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        flops = num_floating_point_operations(longspan_config(shape, f"{tmp}/flops", cuda), shape["batch"])
        builders = moe_builders(shape, tmp, cuda)
        for name in names:
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            try:
                step = builders[name]()
                times = time_kind(step, args.steps, args.warmup, cuda)
            except Exception as exc:  # a kind this machine cannot run is reported, the others still run
                skipped[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                continue
            finally:
                step = None
                gc.collect()
                if cuda:
                    torch.cuda.empty_cache()
            memory = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
            results[name] = (statistics.median(times), memory)
    where = torch.cuda.get_device_name() if cuda else f"CPU, {torch.get_num_threads()} threads"
    print(f"\nMoE shape {args.shape}: {shape}; {args.steps} steps per kind after {args.warmup} warm-up, kinds one "
          f"after another, on {where}; torch {torch.__version__}; peak "
          f"{peak / 1e12 if peak else float('nan'):.3g} TFLOP/s; {flops / 1e12:.3g} TFLOP per step")
    print(f"{'kind':14s} {'median s/step':>14s} {'tokens/s':>10s} {'MFU':>7s} {'peak GiB':>9s}")
    tokens = shape["batch"] * shape["seq"]
    for name, (med, memory) in results.items():
        mfu = flops / med / peak if peak else float("nan")
        print(f"{name:14s} {med:14.4f} {tokens / med:10.0f} {100 * mfu:6.1f}% {memory:9.1f}")
    if "hf-moe" in results:
        for name in results:
            if name.startswith("ls-"):
                print(f"hf-moe / {name} = {results['hf-moe'][0] / results[name][0]:.3f}x (speed-up of longspan)")
    for name, why in skipped.items():
        print(f"{name:14s} skipped: {why}")


def main() -> None:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES) + sorted(MOE_SHAPES), default=None,
                        help="default: 1b (--moe: qwen3-30b-a3b) on CUDA, tiny (--moe: moe-tiny) elsewhere")
    parser.add_argument("--seq", type=int, default=None, help="sequence length (default: the shape's)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--kinds", nargs="*", default=None, help="subset of kinds to run")
    parser.add_argument("--moe", action="store_true", help="the MoE case (see the module docstring)")
    parser.add_argument("--dry-run", action="store_true", help="--moe at moe-tiny: build every kind, one step each")
    args = parser.parse_args()
    if args.dry_run:
        args.moe, args.shape, args.steps, args.warmup = True, "moe-tiny", 1, 0
    shapes = MOE_SHAPES if args.moe else SHAPES
    if args.shape is None:
        args.shape = {(True, True): "qwen3-30b-a3b", (True, False): "moe-tiny", (False, True): "1b",
                      (False, False): "tiny"}[(args.moe, cuda)]
    if args.shape not in shapes:
        parser.error(f"--shape {args.shape} is not one of {', '.join(shapes)}{' (--moe)' if args.moe else ''}")
    shape = dict(shapes[args.shape])
    if args.seq:
        shape["seq"] = args.seq
    from longspan.planner.peak_flops import peak_flops_per_device

    device = torch.device("cuda" if cuda else "cpu")
    peak = peak_flops_per_device(device)
    if args.moe:
        run_moe(args, shape, cuda, peak)
        return
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
