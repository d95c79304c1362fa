"""Training-step speed: longspan vs HF transformers' LlamaForCausalLM vs a bare PyTorch loop.

Same shape for all kinds (4 layers, hidden 256, 4 heads, SwiGLU 768, vocab 32000 (``--vocab``), batch 8 × 256 tokens,
AdamW, gradient clipping at 1.0, fp32, mock tokens). The step kinds are interleaved round-robin and
the medians compared, so machine noise hits them alike.

- ``longspan``: one full iteration of the real trainer (``train_step`` with timers, scheduler and gradient
  norm, then the training log's bookkeeping and ``checkpoint_and_decide_exit``), as ``train()`` runs it,
  with longspan's defaults (``train.torch_compile=None``: compiled where it pays).
- ``ls-eager`` / ``ls-compiled``: the same with ``train.torch_compile`` False / True (per-layer
  ``torch.compile``, longspan.parallel.compile); the compiled kind's compilation happens in the warm-up steps.
- ``bare``: the same longspan model with a hand-written loop (forward, mean loss, backward, clip, the fused
  torch AdamW longspan builds on a CPU). longspan / bare − 1 is the framework overhead.
- ``hf``: LlamaForCausalLM with SDPA attention, loss from labels, torch's AdamW with its defaults (on a CPU
  the per-tensor loop). The issue's 1.3x target is measured against this row.
- ``hf-fused``: the same with ``AdamW(fused=True)``, what HF's ``Trainer`` picks by default with torch >= 2.8
  (``optim="adamw_torch_fused"``): the HF user's step with the same optimizer kernel as longspan's.

Run: ``python benchmarks/bench_train_step.py [--steps 15] [--threads 2] [--kinds longspan,hf,...] [--vocab 4096]
[--profile 25]``
(needs ``transformers``). Print ``uptime`` next to the table: on a shared machine the load moves the numbers.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from longspan.recipes import get_recipe

LAYERS, HIDDEN, HEADS, FFN, VOCAB, SEQ, BATCH = 4, 256, 4, 768, 32000, 256, 8


def longspan_config(run_dir: str, vocab: int = VOCAB):
    cfg = get_recipe("tiny")
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.num_query_groups = LAYERS, HIDDEN, HEADS, HEADS
    m.ffn_hidden_size, m.seq_length, m.vocab_size, m.make_vocab_size_divisible_by = FFN, SEQ, vocab, 128
    cfg.tokenizer.tokenizer_type, cfg.tokenizer.tokenizer_model, cfg.tokenizer.vocab_size = "NullTokenizer", None, vocab - 1
    cfg.dataset.data_path, cfg.dataset.sequence_length = None, SEQ
    cfg.train.micro_batch_size = cfg.train.global_batch_size = BATCH
    cfg.train.train_iters, cfg.train.eval_interval = 10_000, None
    cfg.optimizer.weight_decay, cfg.optimizer.clip_grad = 0.1, 1.0
    cfg.checkpoint.save = cfg.checkpoint.load = None
    cfg.logger.log_interval = 10
    cfg.logger.tensorboard_dir = run_dir
    return cfg


def build_longspan(run_dir: str, torch_compile=None, vocab: int = VOCAB):
    from longspan.training.step.forward_step import forward_step
    from longspan.training.setup import setup
    from longspan.training.utils.train_utils import prepare_forward_step_func

    cfg = longspan_config(run_dir, vocab)
    cfg.train.torch_compile = torch_compile
    out = setup(cfg)
    out.state.fwd = prepare_forward_step_func(forward_step, out.state)
    return out


def longspan_iteration(out, history: list[float], total_loss: dict) -> None:
    """The body of ``train()`` for one iteration (no eval, no checkpoint due)."""
    from longspan.training.train import checkpoint_and_decide_exit, train_step
    from longspan.planner.flops import num_floating_point_operations
    state, ts = out.state, out.state.train_state
    state.num_microbatches_calculator.update(ts.consumed_train_samples, True)
    loss_dict, skipped, _, _, _, grad_norm, zeros = train_step(
        state.fwd, out.train_data_iterator, out.model, out.optimizer, out.scheduler, state
    )
    ts.step += 1
    ts.consumed_train_samples += BATCH
    ts.floating_point_operations_so_far += num_floating_point_operations(state.cfg, BATCH)
    history.append(time.time() - state.start_time)
    _log_iteration(out, loss_dict, total_loss, skipped, grad_norm, zeros, history)
    checkpoint_and_decide_exit(state, out.model, out.optimizer, out.scheduler, ts.floating_point_operations_so_far, {}, None)


def _log_iteration(out, loss_dict, total_loss, skipped, grad_norm, zeros, history) -> None:
    """The trainer's per-iteration log call, in whichever form this checkout has."""
    state, optimizer = out.state, out.optimizer
    try:
        from longspan.training.train import log_iteration
        from longspan.training.observability.log_metrics import IterationMetrics
    except ImportError:
        from longspan.training.utils.train_utils import training_log

        training_log(
            loss_dict, total_loss, optimizer.param_groups[0]["lr"], None, float(optimizer.get_loss_scale()),
            False, skipped, grad_norm, None, zeros, state.cfg, state, history, out.model,
        )
        return
    metrics = IterationMetrics(
        loss_dict=loss_dict, learning_rate=optimizer.param_groups[0]["lr"],
        loss_scale=float(optimizer.get_loss_scale()), skipped_iter=skipped, grad_norm=grad_norm, params_norm=None,
        num_zeros_in_grad=zeros,
    )
    log_iteration(metrics, total_loss, False, state.cfg, state, history, out.model)


def bare_step(model, optimizer, batch) -> None:
    losses = model(batch["tokens"], position_ids=batch["position_ids"], labels=batch["labels"])
    loss = (losses * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()


def build_hf(fused: bool = False, vocab: int = VOCAB):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=SEQ, rms_norm_eps=1e-5,
        tie_word_embeddings=False, attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config)
    fast = {"fused": True} if fused else {}
    return model, torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, betas=(0.9, 0.95), **fast)


def hf_step(model, optimizer, batch) -> None:
    out = model(input_ids=batch["tokens"], labels=batch["tokens"])
    optimizer.zero_grad(set_to_none=True)
    out.loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()


class _OpCPUTime(TorchDispatchMode):
    """Thread CPU time per ATen operator (forward and backward: on a CPU autograd runs the backward on the calling
    thread), so the breakdown does not move with the machine's load as wall-clock profiles do. With more than one
    thread the intra-op workers' time is missed: profile with ``--threads 1``."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        start = time.thread_time()
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket.__name__)
        self.seconds[name] = self.seconds.get(name, 0.0) + time.thread_time() - start
        self.calls[name] = self.calls.get(name, 0) + 1
        return out


def print_profile(name: str, step, rows: int, steps: int = 3) -> None:
    """``steps`` steps of ``step``: the thread CPU time of a plain step (median), and under ``_OpCPUTime`` the
    ``rows`` costliest operators per step and the time outside every operator (Python: the framework's own work,
    plus the mode's own cost per call)."""
    plain = []
    for _ in range(steps):
        start = time.thread_time()
        step()
        plain.append(time.thread_time() - start)
    mode = _OpCPUTime()
    start = time.thread_time()
    with mode:
        for _ in range(steps):
            step()
    total = (time.thread_time() - start) / steps
    in_ops = sum(mode.seconds.values()) / steps
    print(f"\n{name}: thread CPU time per step {statistics.median(plain) * 1e3:.1f} ms (median of {steps}); "
          f"profiled {total * 1e3:.1f} ms = {in_ops * 1e3:.1f} in {sum(mode.calls.values()) // steps} operator "
          f"calls + {(total - in_ops) * 1e3:.1f} outside them")
    for op, seconds in sorted(mode.seconds.items(), key=lambda kv: -kv[1])[:rows]:
        print(f"  {op:36s} {seconds / steps * 1e3:9.2f} ms {mode.calls[op] // steps:6d} calls "
              f"{100 * seconds / steps / total:6.1f}%")


KINDS = ("longspan", "ls-eager", "ls-compiled", "bare", "hf", "hf-fused")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated subset of {','.join(KINDS)}")
    parser.add_argument("--vocab", type=int, default=VOCAB, help=f"vocabulary size (default {VOCAB})")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="after the timed steps, profile 3 more steps of each kind and print its N costliest "
                             "operators by thread CPU time (use with --threads 1)")
    args = parser.parse_args()
    names = [name for name in args.kinds.split(",") if name]
    unknown = sorted(set(names) - set(KINDS))
    if unknown or not names:
        parser.error(f"--kinds: unknown {unknown}; choose from {','.join(KINDS)}")
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as run_dir:
        out = build_longspan(f"{run_dir}/default", vocab=args.vocab)  # longspan's default (train.torch_compile=None)
        batch = next(out.train_data_iterator)
        runs = {}
        for name in names:
            if name == "longspan":
                history: list[float] = []
                total_loss: dict = {}
                runs[name] = lambda h=history, t=total_loss: longspan_iteration(out, h, t)
            elif name in ("ls-eager", "ls-compiled"):
                built = build_longspan(f"{run_dir}/{name}", torch_compile=name == "ls-compiled", vocab=args.vocab)
                history_k: list[float] = []
                loss_k: dict = {}
                runs[name] = lambda b=built, h=history_k, t=loss_k: longspan_iteration(b, h, t)
            elif name == "bare":
                bare_model = out.state.cfg.model.provide()
                # The same torch AdamW kernel longspan builds on a CPU (fused), so the difference is the framework.
                bare_opt = torch.optim.AdamW(
                    bare_model.parameters(), lr=3e-4, weight_decay=0.1, betas=(0.9, 0.95), fused=True
                )
                runs[name] = lambda m=bare_model, o=bare_opt: bare_step(m, o, batch)
            else:
                hf_model, hf_opt = build_hf(fused=name == "hf-fused", vocab=args.vocab)
                runs[name] = lambda m=hf_model, o=hf_opt: hf_step(m, o, batch)
        times: dict[str, list[float]] = {name: [] for name in runs}
        for step in range(args.warmup + args.steps):
            k = step % len(names)
            order = names[k:] + names[:k]  # rotate so no kind always runs first
            for name in order:
                fn = runs[name]
                start = time.perf_counter()
                fn()
                if step >= args.warmup:
                    times[name].append(time.perf_counter() - start)
        if args.profile:
            for name in names:
                print_profile(name, runs[name], args.profile)

    med = {name: statistics.median(t) for name, t in times.items()}
    tokens = BATCH * SEQ
    base = "longspan" if "longspan" in med else names[0]
    print(f"\nshape: {LAYERS} layers, hidden {HIDDEN}, heads {HEADS}, ffn {FFN}, vocab {args.vocab}, batch {BATCH}x{SEQ}; "
          f"{args.steps} interleaved steps, {args.threads} threads, torch {torch.__version__}")
    print(f"longspan default: train.torch_compile=None -> compiled on CPU: {out.state.compiled}")
    print(f"{'':12s} {'median s/step':>14s} {'min s/step':>11s} {'tokens/s':>10s} {'vs ' + base:>14s}")
    for name in names:
        print(f"{name:12s} {med[name]:14.4f} {min(times[name]):11.4f} {tokens / med[name]:10.0f} "
              f"{med[name] / med[base]:14.3f}")
    print()
    for ls_kind in ("longspan", "ls-eager", "ls-compiled"):
        for hf_kind in ("hf", "hf-fused"):
            if ls_kind in med and hf_kind in med:
                ratio = f"{hf_kind} / {ls_kind}"
                print(f"{ratio:24s} = {med[hf_kind] / med[ls_kind]:.3f}x  (speed-up of longspan; medians)")
    if "bare" in med and "longspan" in med:
        print(f"framework overhead = {100 * (med['longspan'] / med['bare'] - 1):+.2f}% of a bare loop on the same model")


if __name__ == "__main__":
    main()
