"""Training-step speed: longspan vs HF transformers' LlamaForCausalLM vs a bare PyTorch loop.

Same shape for all kinds (4 layers, hidden 256, 4 heads, SwiGLU 768, vocab 32000, batch 8 × 256 tokens,
AdamW, gradient clipping at 1.0, fp32, mock tokens). The step kinds are interleaved round-robin and
the medians compared, so machine noise hits them alike.

- ``longspan``: one full iteration of the real trainer (``train_step`` with timers, scheduler and gradient
  norm, then the training log's bookkeeping and ``checkpoint_and_decide_exit``), as ``train()`` runs it,
  with longspan's defaults (``train.torch_compile=None``: compiled where it pays).
- ``ls-eager`` / ``ls-compiled``: the same with ``train.torch_compile`` False / True (per-layer
  ``torch.compile``, longspan.training.compile); the compiled kind's compilation happens in the warm-up steps.
- ``bare``: the same longspan model with a hand-written loop (forward, mean loss, backward, clip, AdamW).
  longspan / bare − 1 is the framework overhead.
- ``hf``: LlamaForCausalLM with SDPA attention, loss from labels, torch's AdamW with its defaults.

Run: ``python benchmarks/bench_train_step.py [--steps 15] [--threads 2]`` (needs ``transformers``).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from longspan.recipes import get_recipe

LAYERS, HIDDEN, HEADS, FFN, VOCAB, SEQ, BATCH = 4, 256, 4, 768, 32000, 256, 8


def longspan_config(run_dir: str):
    cfg = get_recipe("tiny")
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.num_query_groups = LAYERS, HIDDEN, HEADS, HEADS
    m.ffn_hidden_size, m.seq_length, m.vocab_size, m.make_vocab_size_divisible_by = FFN, SEQ, VOCAB, 128
    cfg.tokenizer.tokenizer_type, cfg.tokenizer.tokenizer_model, cfg.tokenizer.vocab_size = "NullTokenizer", None, VOCAB - 1
    cfg.dataset.data_path, cfg.dataset.sequence_length = None, SEQ
    cfg.train.micro_batch_size = cfg.train.global_batch_size = BATCH
    cfg.train.train_iters, cfg.train.eval_interval = 10_000, None
    cfg.optimizer.weight_decay, cfg.optimizer.clip_grad = 0.1, 1.0
    cfg.checkpoint.save = cfg.checkpoint.load = None
    cfg.logger.log_interval = 10
    cfg.logger.tensorboard_dir = run_dir
    return cfg


def build_longspan(run_dir: str, torch_compile=None):
    from longspan.training.forward_step import forward_step
    from longspan.training.setup import setup
    from longspan.training.utils.train_utils import prepare_forward_step_func

    cfg = longspan_config(run_dir)
    cfg.train.torch_compile = torch_compile
    out = setup(cfg)
    out.state.fwd = prepare_forward_step_func(forward_step, out.state)
    return out


def longspan_iteration(out, history: list[float], total_loss: dict) -> None:
    """The body of ``train()`` for one iteration (no eval, no checkpoint due)."""
    from longspan.training.train import checkpoint_and_decide_exit, train_step
    from longspan.training.utils.flop_utils import num_floating_point_operations
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
        from longspan.training.utils.log_metrics import IterationMetrics
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


def build_hf():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=SEQ, rms_norm_eps=1e-5,
        tie_word_embeddings=False, attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, betas=(0.9, 0.95))


def hf_step(model, optimizer, batch) -> None:
    out = model(input_ids=batch["tokens"], labels=batch["tokens"])
    optimizer.zero_grad(set_to_none=True)
    out.loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as run_dir, tempfile.TemporaryDirectory() as run_dir_2, \
            tempfile.TemporaryDirectory() as run_dir_3:
        out = build_longspan(run_dir)  # longspan's default (train.torch_compile=None)
        eager = build_longspan(run_dir_2, torch_compile=False)
        compiled = build_longspan(run_dir_3, torch_compile=True)
        history_e: list[float] = []
        history_c: list[float] = []
        loss_e: dict = {}
        loss_c: dict = {}
        bare_model = out.state.cfg.model.provide()
        # The same torch AdamW implementation longspan uses (foreach), so the difference is the framework.
        bare_opt = torch.optim.AdamW(
            bare_model.parameters(), lr=3e-4, weight_decay=0.1, betas=(0.9, 0.95), foreach=True
        )
        hf_model, hf_opt = build_hf()
        batch = next(out.train_data_iterator)
        history: list[float] = []
        total_loss: dict = {}
        runs = {
            "longspan": lambda: longspan_iteration(out, history, total_loss),
            "ls-eager": lambda: longspan_iteration(eager, history_e, loss_e),
            "ls-compiled": lambda: longspan_iteration(compiled, history_c, loss_c),
            "bare": lambda: bare_step(bare_model, bare_opt, batch),
            "hf": lambda: hf_step(hf_model, hf_opt, batch),
        }
        times: dict[str, list[float]] = {name: [] for name in runs}
        names = list(runs)
        for step in range(args.warmup + args.steps):
            k = step % len(names)
            order = names[k:] + names[:k]  # rotate so no kind always runs first
            for name in order:
                fn = runs[name]
                start = time.perf_counter()
                fn()
                if step >= args.warmup:
                    times[name].append(time.perf_counter() - start)

    med = {name: statistics.median(t) for name, t in times.items()}
    tokens = BATCH * SEQ
    print(f"\nshape: {LAYERS} layers, hidden {HIDDEN}, heads {HEADS}, ffn {FFN}, vocab {VOCAB}, batch {BATCH}x{SEQ}; "
          f"{args.steps} interleaved steps, {args.threads} threads, torch {torch.__version__}")
    print(f"{'':10s} {'median s/step':>14s} {'tokens/s':>10s} {'vs longspan':>12s}")
    print(f"longspan default: train.torch_compile=None -> compiled on CPU: {out.state.compiled}")
    for name in ("longspan", "ls-eager", "ls-compiled", "bare", "hf"):
        print(f"{name:10s} {med[name]:14.4f} {tokens / med[name]:10.0f} {med[name] / med['longspan']:12.3f}")
    print(f"\nlongspan / hf          = {med['longspan'] / med['hf']:.3f}  (< 1 means longspan is faster)")
    print(f"hf / ls-compiled       = {med['hf'] / med['ls-compiled']:.3f}x  (speed-up of the compiled path over HF)")
    print(f"hf / ls-eager          = {med['hf'] / med['ls-eager']:.3f}x")
    print(f"framework overhead     = {100 * (med['longspan'] / med['bare'] - 1):+.2f}% of a bare loop on the same model")


if __name__ == "__main__":
    main()
