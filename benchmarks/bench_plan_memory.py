"""``longspan plan``'s per-rank memory estimate against the measured peak of real CPU training runs.

Each case is a short ``pretrain`` run (mock data, fp32, AdamW, no checkpoints or evaluation) in fresh
processes (one, or two through the test harness's worker pool with gloo). The measured figure is the rise
of the process's peak resident set (Linux ``VmHWM`` after ``/proc/self/clear_refs``) over the whole run,
from just before ``pretrain`` starts; with several ranks, the largest rank's. The estimate is the planner's
total for the busiest rank at the same layout.

Run: ``python benchmarks/bench_plan_memory.py [--cases NAME ...]``; prints a markdown table (docs/plan.md).
``--one NAME`` measures one single-process case in this process and prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

MiB = 2**20

#: a smaller shape for the cheap cases the test runs
SMALL = {"model.num_layers": 2, "model.hidden_size": 128, "model.ffn_hidden_size": 384,
         "tokenizer.vocab_size": 15999, "model.seq_length": 128}

#: name -> (world size, model/train overrides); base: 4 layers, hidden 256, vocab 32000, seq 256, mbs 4, gbs 8
CASES: dict[str, tuple[int, dict[str, Any]]] = {
    "one": (1, {}),
    "one-recompute-full": (1, {"model.recompute_granularity": "full", "model.recompute_method": "uniform",
                               "model.recompute_num_layers": 1}),
    "one-fused-loss": (1, {"model.cross_entropy_loss_fusion": True}),
    "one-seq512-mbs2": (1, {"model.seq_length": 512, "train.micro_batch_size": 2}),
    "one-small": (1, SMALL),
    "one-small-fused": (1, {**SMALL, "model.cross_entropy_loss_fusion": True}),
    "dp2-small-fsdp2": (2, {**SMALL, "dist.use_torch_fsdp2": True}),
    "dp2-ddp": (2, {}),
    "dp2-distopt": (2, {"optimizer.use_distributed_optimizer": True}),
    "dp2-fsdp2": (2, {"dist.use_torch_fsdp2": True}),
    "tp2": (2, {"model.tensor_model_parallel_size": 2}),
    "pp2": (2, {"model.pipeline_model_parallel_size": 2}),
    "cp2": (2, {"model.context_parallel_size": 2}),
}


def case_config(name: str) -> Any:
    from longspan.recipes import get_recipe

    cfg = get_recipe("tiny")
    m = cfg.model
    m.num_layers, m.hidden_size, m.ffn_hidden_size, m.num_attention_heads, m.num_query_groups = 4, 256, 768, 4, 4
    m.seq_length, m.vocab_size, m.make_vocab_size_divisible_by = 256, None, 128
    m.hidden_dropout = m.attention_dropout = 0.0
    cfg.tokenizer.tokenizer_type, cfg.tokenizer.tokenizer_model, cfg.tokenizer.vocab_size = "NullTokenizer", None, 31999
    cfg.dataset.data_path = None
    t = cfg.train
    t.micro_batch_size, t.global_batch_size, t.train_iters, t.eval_interval, t.eval_iters = 4, 8, 2, None, 0
    cfg.scheduler.lr_warmup_fraction, cfg.scheduler.lr_warmup_iters = None, 0
    cfg.checkpoint.save = cfg.checkpoint.load = None
    cfg.logger.tensorboard_dir = None
    cfg.logger.log_interval = 1
    cfg.dist.distributed_backend, cfg.dist.distributed_timeout_minutes = "gloo", 2
    for key, value in CASES[name][1].items():
        section, field = key.split(".")
        setattr(getattr(cfg, section), field, value)
    cfg.dataset.sequence_length = m.seq_length
    return cfg


def estimate(name: str) -> float:
    """The planner's total bytes for the busiest rank of case ``name``."""
    from longspan.parallel.mesh import layout_from_config
    from longspan.planner.plan import estimate_memory

    cfg = case_config(name)
    cfg.model.vocab_size = cfg.tokenizer.vocab_size + 1
    cfg.model.finalize()
    layout = layout_from_config(CASES[name][0], cfg.model)
    return estimate_memory(cfg, layout).total


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def measure_here(name: str) -> float:
    """Peak RSS rise (bytes) of a pretrain run of case ``name`` in this process (one rank of it)."""
    import gc

    import torch

    from longspan.training.pretrain import pretrain

    torch.set_num_threads(1)
    cfg = case_config(name)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    start = _status_kib("VmRSS")
    pretrain(cfg)
    return float((_status_kib("VmHWM") - start) * 1024)


def _measure_in_child(name: str, results: Any) -> None:
    import logging

    logging.disable(logging.CRITICAL)
    results.send(measure_here(name))


def _fresh_process_context() -> Any:
    """A forkserver whose server process has imported torch and the trainer once: each measurement runs in a
    child forked from it, a process as fresh as a new interpreter after its imports, without paying for them."""
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "longspan.training.pretrain", __name__])
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # the server's environment, inherited by every child
    try:
        from multiprocessing import forkserver

        forkserver.ensure_running()
    finally:
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved
    return ctx


def measure(name: str, repeats: int = 3) -> float:
    """Measured bytes of case ``name`` in fresh processes (largest rank).

    One process's peak RSS varies by up to ~18% between identical runs (where the allocator happens to place
    short-lived buffers), so a single-process case takes the smallest of ``repeats`` fresh runs: the steady
    peak that the planner's tensor accounting describes.
    """
    world = CASES[name][0]
    if world == 1:
        ctx = _fresh_process_context()
        runs = []
        for _ in range(repeats):
            receive, send = ctx.Pipe(duplex=False)
            child = ctx.Process(target=_measure_in_child, args=(name, send))
            child.start()
            send.close()
            try:
                runs.append(float(receive.recv()))
            except EOFError:
                child.join()
                raise RuntimeError(f"measuring {name} failed in a fresh process (exit {child.exitcode})") from None
            child.join()
        return min(runs)
    from tests.parallel.harness import run_distributed

    return max(run_distributed(measure_here, world, name, timeout=600))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", default=list(CASES))
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        import logging

        logging.disable(logging.CRITICAL)
        value = measure_here(args.one)
        sys.stdout.flush()
        print(json.dumps({"measured": value}))
        return
    print("| case | ranks | estimate (MiB) | measured peak (MiB) | error |")
    print("| --- | --- | --- | --- | --- |")
    for name in args.cases:
        est, got = estimate(name), measure(name)
        print(f"| {name} | {CASES[name][0]} | {est / MiB:.0f} | {got / MiB:.0f} | {100 * (est - got) / got:+.1f}% |",
              flush=True)


if __name__ == "__main__":
    main()
