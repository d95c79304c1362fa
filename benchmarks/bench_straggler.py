"""Straggler detection overhead: what turning on ``nvrx_straggler`` (or ``straggler.log_straggler``) costs per step.

Two measurements on one process (CPU here; the detector's work is the same on any device):

1. direct: the detector's own per-iteration work (timer start/stop, the report check, and a report with its
   all-gather every ``log_interval`` iterations; here every iteration, the worst case), timed over many
   iterations, as a fraction of a real training step of the model below;
2. end to end: full ``pretrain`` runs with and without the detector, interleaved, median wall time per run.

Run: ``python benchmarks/bench_straggler.py [--steps 30] [--reps 3]``. On a shared machine (2) is noisy;
(1) is the number to quote.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from longspan.recipes import get_recipe
from longspan.config.schema.infra import NVRxStragglerDetectionConfig
from longspan.training.pretrain import pretrain
from longspan.training.resilience.straggler import StragglerDetector, StragglerSettings


def config(run_dir: str, steps: int, straggler: bool):
    cfg = get_recipe("tiny")
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.num_query_groups, m.ffn_hidden_size = 4, 256, 4, 4, 768
    m.seq_length, m.vocab_size = 256, None
    cfg.tokenizer.tokenizer_type, cfg.tokenizer.tokenizer_model, cfg.tokenizer.vocab_size = "NullTokenizer", None, 8191
    cfg.dataset.data_path, cfg.dataset.sequence_length = None, 256
    cfg.train.micro_batch_size, cfg.train.global_batch_size, cfg.train.train_iters = 4, 8, steps
    cfg.train.eval_interval, cfg.train.eval_iters = None, 0
    cfg.scheduler.lr_warmup_fraction, cfg.scheduler.lr_warmup_iters = None, 2
    cfg.checkpoint.save = cfg.checkpoint.load = None
    cfg.logger.log_interval = 1
    cfg.logger.tensorboard_dir = str(Path(run_dir) / "tb")
    if straggler:
        cfg.nvrx_straggler = NVRxStragglerDetectionConfig(enabled=True, report_time_interval=0.0)
    return cfg


def direct_cost(iterations: int = 20000) -> float:
    detector = StragglerDetector(StragglerSettings(report_every_seconds=0.0, num_to_print=1,
                                                   relative_threshold=0.7, individual_threshold=0.7))
    start = time.perf_counter()
    for it in range(1, iterations + 1):
        detector.iteration_started()
        detector.iteration_done()
        report = detector.maybe_report(it)
        detector.format(report)
    return (time.perf_counter() - start) / iterations


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.reps):
        for on in (False, True):
            with tempfile.TemporaryDirectory() as run_dir:
                cfg = config(run_dir, args.steps, on)
                start = time.perf_counter()
                pretrain(cfg)
                times[on].append((time.perf_counter() - start) / args.steps)
    off, on = statistics.median(times[False]), statistics.median(times[True])
    per_iter = direct_cost()
    print(f"step time (median of {args.reps} runs of {args.steps} steps, incl. start-up): off {off * 1e3:.1f} ms, "
          f"on {on * 1e3:.1f} ms ({(on / off - 1) * 100:+.2f}%, noisy)")
    print(f"detector's own work per iteration (report every iteration): {per_iter * 1e6:.1f} us = "
          f"{per_iter / off * 100:.3f}% of a step")


if __name__ == "__main__":
    main()
