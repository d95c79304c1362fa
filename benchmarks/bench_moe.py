"""MoE training-step speed on CPU: longspan (grouped expert GEMMs and the sequential loop) beside HF transformers'
Qwen3MoeForCausalLM (its default experts implementation, and ``grouped_mm``).

Shapes (``--shape``): ``e32`` = 2 layers, hidden 256, 8 heads / 4 query groups (head dim 32), QK-norm, every
layer MoE with 32 SwiGLU experts of width 128 routed top-4 (softmax after top-k, HF: ``norm_topk_prob``),
vocab 4096, batch 4 × 256 tokens, fp32, AdamW (fused on both sides) and gradient clipping at 1.0; ``e128`` =
the same with 128 experts top-8.

- ``longspan``: one iteration of the real trainer (``train_step``, scheduler, gradient norm, the training
  log's bookkeeping) on the ``tiny-moe`` recipe's MoE settings (``moe_grouped_gemm=True``) at that shape;
- ``ls-seq``: the same with ``moe_grouped_gemm=False`` (the expert-by-expert reference loop);
- ``hf``: Qwen3MoeForCausalLM with its default experts implementation (named in the output), SDPA attention,
  loss from labels, ``AdamW(fused=True)`` (HF Trainer's default optimizer with torch >= 2.8);
- ``hf-grouped``: the same with ``experts_implementation="grouped_mm"``.

The kinds run interleaved in ``--rounds`` rounds of ``--steps`` steps; each kind's time is the best round's
median. One thread by default. The load average is printed with the table: on a shared machine it moves the
numbers, so compare kinds of one run only.

Run: ``python benchmarks/bench_moe.py [--shape e32|e128|both] [--rounds 2] [--steps 5] [--threads 1]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from bench_train_step import longspan_iteration

LAYERS, HIDDEN, HEADS, GROUPS, VOCAB, SEQ, BATCH, EXPERT_FFN = 2, 256, 8, 4, 4096, 256, 4, 128
SHAPES = {"e32": (32, 4), "e128": (128, 8)}
KINDS = ("longspan", "ls-seq", "hf", "hf-grouped")


def longspan_config(run_dir: str, experts: int, topk: int, grouped: bool):
    from longspan.recipes import get_recipe

    cfg = get_recipe("tiny-moe")
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.num_query_groups = LAYERS, HIDDEN, HEADS, GROUPS
    m.ffn_hidden_size, m.seq_length, m.vocab_size, m.make_vocab_size_divisible_by = 4 * HIDDEN, SEQ, VOCAB, 128
    m.num_moe_experts, m.moe_router_topk, m.moe_ffn_hidden_size = experts, topk, EXPERT_FFN
    m.qk_layernorm = True
    m.moe_grouped_gemm = grouped
    cfg.tokenizer.tokenizer_type, cfg.tokenizer.tokenizer_model, cfg.tokenizer.vocab_size = "NullTokenizer", None, VOCAB - 1
    cfg.dataset.data_path, cfg.dataset.sequence_length = None, SEQ
    cfg.train.micro_batch_size = cfg.train.global_batch_size = BATCH
    cfg.train.train_iters, cfg.train.eval_interval = 10_000, None
    cfg.optimizer.weight_decay, cfg.optimizer.clip_grad = 0.1, 1.0
    cfg.checkpoint.save = cfg.checkpoint.load = None
    cfg.logger.log_interval = 10
    cfg.logger.tensorboard_dir = run_dir
    return cfg


def build_longspan(run_dir: str, experts: int, topk: int, grouped: bool):
    from longspan.training.setup import setup
    from longspan.training.step.forward_step import forward_step
    from longspan.training.utils.train_utils import prepare_forward_step_func

    out = setup(longspan_config(run_dir, experts, topk, grouped))
    out.state.fwd = prepare_forward_step_func(forward_step, out.state)
    return out


def build_hf(experts: int, topk: int, implementation: str | None):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=4 * HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=GROUPS, head_dim=HIDDEN // HEADS,
        max_position_embeddings=SEQ, rms_norm_eps=1e-5, tie_word_embeddings=False, num_experts=experts,
        num_experts_per_tok=topk, moe_intermediate_size=EXPERT_FFN, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], attn_implementation="sdpa",
    )
    kwargs = {} if implementation is None else {"experts_implementation": implementation}
    model = Qwen3MoeForCausalLM._from_config(config, **kwargs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, betas=(0.9, 0.95), fused=True)
    return model, optimizer, model.config._experts_implementation


def hf_step(model, optimizer, tokens: torch.Tensor) -> None:
    out = model(input_ids=tokens, labels=tokens)
    optimizer.zero_grad(set_to_none=True)
    out.loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()


def measure(shape: str, names: list[str], rounds: int, steps: int, warmup: int) -> tuple[dict, str]:
    """Best-round median seconds per step of each kind, and the name of HF's default experts implementation."""
    experts, topk = SHAPES[shape]
    tokens = torch.randint(0, VOCAB - 1, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    runs, hf_default = {}, "-"
    with tempfile.TemporaryDirectory() as run_dir:
        for name in names:
            if name in ("longspan", "ls-seq"):
                built = build_longspan(f"{run_dir}/{name}", experts, topk, grouped=name == "longspan")
                runs[name] = lambda b=built, h=[], t={}: longspan_iteration(b, h, t)
            else:
                model, opt, impl = build_hf(experts, topk, "grouped_mm" if name == "hf-grouped" else None)
                if name == "hf":
                    hf_default = impl
                runs[name] = lambda m=model, o=opt: hf_step(m, o, tokens)
        for fn in runs.values():
            for _ in range(warmup):
                fn()
        best: dict[str, float] = {}
        for r in range(rounds):
            times: dict[str, list[float]] = {name: [] for name in runs}
            for step in range(steps):
                k = (step + r) % len(names)
                for name in names[k:] + names[:k]:  # rotate so no kind always runs first
                    start = time.perf_counter()
                    runs[name]()
                    times[name].append(time.perf_counter() - start)
            for name, t in times.items():
                best[name] = min(best.get(name, float("inf")), statistics.median(t))
    return best, hf_default


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="both", choices=[*SHAPES, "both"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated subset of {','.join(KINDS)}")
    args = parser.parse_args()
    names = [name for name in args.kinds.split(",") if name]
    if not names or set(names) - set(KINDS):
        parser.error(f"--kinds: choose from {','.join(KINDS)}")
    torch.set_num_threads(args.threads)
    shapes = list(SHAPES) if args.shape == "both" else [args.shape]
    for shape in shapes:
        load_before = os.getloadavg()
        best, hf_default = measure(shape, names, args.rounds, args.steps, args.warmup)
        load_after = os.getloadavg()
        experts, topk = SHAPES[shape]
        print(f"\n{shape}: {LAYERS} layers, hidden {HIDDEN}, {experts} experts top-{topk}, expert width {EXPERT_FFN}, "
              f"QK-norm, vocab {VOCAB}, batch {BATCH}x{SEQ}; best of {args.rounds} rounds x {args.steps} interleaved "
              f"steps (median), {args.threads} thread(s), torch {torch.__version__}; HF default experts: {hf_default}")
        print(f"load average (1/5/15 min): before {load_before[0]:.2f}/{load_before[1]:.2f}/{load_before[2]:.2f}, "
              f"after {load_after[0]:.2f}/{load_after[1]:.2f}/{load_after[2]:.2f}")
        base = "longspan" if "longspan" in best else names[0]
        print(f"{'':12s} {'s/step':>8s} {'tokens/s':>9s} {'÷ ' + base:>12s}")
        for name in names:
            print(f"{name:12s} {best[name]:8.4f} {BATCH * SEQ / best[name]:9.0f} {best[name] / best[base]:12.3f}")
        for hf_kind in ("hf", "hf-grouped"):
            if hf_kind in best and "longspan" in best:
                print(f"{hf_kind} / longspan = {best[hf_kind] / best['longspan']:.3f}x (speed-up of longspan)")


if __name__ == "__main__":
    main()
