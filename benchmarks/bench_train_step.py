"""Training-step speed: longspan vs HF transformers' LlamaForCausalLM vs a bare PyTorch loop.

Same shape for all three (4 layers, hidden 256, 4 heads, SwiGLU 768, vocab 32000, batch 8 × 256 tokens,
AdamW, gradient clipping at 1.0, fp32, mock tokens). The three step kinds are interleaved round-robin and
the medians compared, so machine noise hits them alike.

- ``longspan``: one full iteration of the real trainer (``train_step`` with timers, scheduler and gradient
  norm, then ``training_log``'s bookkeeping and ``checkpoint_and_decide_exit``), as ``train()`` runs it.
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


def build_longspan(run_dir: str):
    from longspan.training.forward_step import forward_step
    from longspan.training.setup import setup
    from longspan.training.utils.train_utils import prepare_forward_step_func

    out = setup(longspan_config(run_dir))
    out.state.fwd = prepare_forward_step_func(forward_step, out.state)
    return out


def longspan_iteration(out, history: list[float], total_loss: dict) -> None:
    """The body of ``train()`` for one iteration (no eval, no checkpoint due)."""
    from longspan.training.train import checkpoint_and_decide_exit, train_step
    from longspan.training.utils.flop_utils import num_floating_point_operations
    from longspan.training.utils.train_utils import training_log

    state, ts = out.state, out.state.train_state
    state.num_microbatches_calculator.update(ts.consumed_train_samples, True)
    loss_dict, skipped, _, _, _, grad_norm, zeros = train_step(
        state.fwd, out.train_data_iterator, out.model, out.optimizer, out.scheduler, state
    )
    ts.step += 1
    ts.consumed_train_samples += BATCH
    ts.floating_point_operations_so_far += num_floating_point_operations(state.cfg, BATCH)
    history.append(time.time() - state.start_time)
    training_log(
        loss_dict, total_loss, out.optimizer.param_groups[0]["lr"], None, float(out.optimizer.get_loss_scale()),
        False, skipped, grad_norm, None, zeros, state.cfg, state, history, out.model,
    )
    checkpoint_and_decide_exit(state, out.model, out.optimizer, out.scheduler, ts.floating_point_operations_so_far, {}, None)


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

    with tempfile.TemporaryDirectory() as run_dir:
        out = build_longspan(run_dir)
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
            "bare": lambda: bare_step(bare_model, bare_opt, batch),
            "hf": lambda: hf_step(hf_model, hf_opt, batch),
        }
        times: dict[str, list[float]] = {name: [] for name in runs}
        names = list(runs)
        for step in range(args.warmup + args.steps):
            order = names[step % 3:] + names[: step % 3]  # rotate so no kind always runs first
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
    for name in ("longspan", "bare", "hf"):
        print(f"{name:10s} {med[name]:14.4f} {tokens / med[name]:10.0f} {med[name] / med['longspan']:12.3f}")
    print(f"\nlongspan / hf          = {med['longspan'] / med['hf']:.3f}  (< 1 means longspan is faster)")
    print(f"framework overhead     = {100 * (med['longspan'] / med['bare'] - 1):+.2f}% of a bare loop on the same model")


if __name__ == "__main__":
    main()
