"""SFT throughput with and without sequence packing, on a dataset with skewed lengths; and JSONL indexing speed.

    PYTHONPATH=. python benchmarks/bench_sft_packing.py [--records 2000] [--seq 256] [--steps 6] [--index-mb 150]

Data: prompt/completion records of NullTokenizer ids (space-separated integers), lengths drawn from a
log-normal distribution (most samples short, a few near ``--seq``), as real SFT sets are. Model: a tiny GPT
(2 layers, hidden 64, 4 heads, vocab 256) trained with AdamW on CPU, ``--mbs`` samples per step, the trainer's
forward step and loss. Three modes, each from the datasets the trainer builds (``build_sft_datasets``):

- ``pad to seq``: unpacked, every microbatch padded to ``--seq`` (the default, needed by pipeline parallel);
- ``pad to longest``: unpacked, padded to the longest sample of the microbatch (``pad_to_max_length=False``);
- ``packed``: first-fit-decreasing packs of ``--seq`` tokens with block-diagonal masks.

Reported per mode: time per step; processed tokens/s (everything the model runs, padding included); real
tokens/s (document tokens, the work that matters); loss tokens/s; useful-token fraction (real / processed);
and documents/s. The indexing part writes a ``--index-mb`` MB JSONL file and times the first index build
(the one-off scan) and a second open (the cached index).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from functools import partial
from types import SimpleNamespace as NS

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from longspan.data.sft.dataset import build_sft_datasets  # noqa: E402
from longspan.data.sft.jsonl_index import JsonlIndex  # noqa: E402
from longspan.data.tokenizers import NullTokenizer  # noqa: E402

PAD_ID = 255  # NullTokenizer(255) has no pad token: padding uses its EOD id, 255


def write_skewed_dataset(root: str, records: int, seq: int, seed: int = 0) -> float:
    """training.jsonl with log-normal record lengths; returns the mean document length in tokens."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(mean=np.log(seq / 8), sigma=0.9, size=records), 4, seq).astype(int)
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, "training.jsonl"), "w") as f:
        for n in lengths:
            prompt = max(1, int(n * rng.uniform(0.3, 0.8)))
            ids = rng.integers(1, 250, size=n)
            f.write(json.dumps({"input": " ".join(map(str, ids[:prompt])),
                                "output": " ".join(map(str, ids[prompt:n - 1]))}) + "\n")
    return float(lengths.mean())


def tiny_model(seq: int):
    import torch.nn.functional as F

    from longspan.models.gpt import build_gpt_model
    from longspan.models.gpt_provider import GPTModelProvider

    provider = GPTModelProvider(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                                num_query_groups=4, seq_length=seq, vocab_size=256, make_vocab_size_divisible_by=128,
                                normalization="RMSNorm", position_embedding_type="rope", gated_linear_unit=True,
                                activation_func=F.silu, add_bias_linear=False, attention_dropout=0.0,
                                hidden_dropout=0.0)
    provider.finalize()
    return build_gpt_model(provider, seed=1234, device="cpu")


def run_mode(name: str, root: str, seq: int, mbs: int, steps: int, packed: bool, pad_to_max: bool) -> dict:
    from longspan.training.step.forward_step import forward_step
    from longspan.training.observability.timers import Timers

    tokenizer = NullTokenizer(255)
    kwargs = None if pad_to_max else {"pad_to_max_length": False, "pad_seq_length_to_mult": 16}
    cfg = NS(dataset_root=root, seed=1234, memmap_workers=1, max_train_samples=None, dataset_kwargs=kwargs,
             packed_sequence_specs={"packed_sequence_size": seq} if packed else None, do_validation=False,
             do_test=False)
    train = build_sft_datasets(cfg, tokenizer, ((steps + 1) * mbs, 0, 0), seq)[0]
    loader = torch.utils.data.DataLoader(train, batch_size=mbs, collate_fn=train.collate_fn)
    model = tiny_model(seq)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = NS(timers=Timers(0, "minmax"), device=torch.device("cpu"), cfg=NS(dataset=cfg))
    step_fn = partial(forward_step, state)
    times, processed, real, loss_tokens, docs = [], 0, 0, 0, 0
    for index, batch in enumerate(loader):
        if index > steps:
            break
        start = time.perf_counter()
        output, loss_func = step_fn(iter([batch]), model)
        loss, num_tokens, _ = loss_func(output)
        (loss / num_tokens.clamp(min=1)).backward()
        optimizer.step()
        optimizer.zero_grad()
        elapsed = time.perf_counter() - start
        if index == 0:
            continue  # warm-up
        times.append(elapsed)
        processed += batch["tokens"].numel()
        loss_tokens += int(batch["loss_mask"].sum())
        # NullTokenizer(255) pads with EOD (255); documents never contain it as an input token (ids 1..249, and
        # the EOS is only ever a label), so the real tokens are the others
        is_pad = batch["tokens"] == PAD_ID
        real += int((~is_pad).sum())
        starts = (batch["position_ids"] == 0) & ~is_pad
        docs += int(starts.sum())
    total = sum(times)
    return {"mode": name, "step_ms": 1000 * statistics.median(times), "processed_tok_s": processed / total,
            "real_tok_s": real / total, "loss_tok_s": loss_tokens / total, "useful_fraction": real / processed,
            "docs_s": docs / total}


def bench_indexing(megabytes: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "big.jsonl")
        rng = np.random.default_rng(0)
        lines = [json.dumps({"input": "x" * int(n), "output": "y" * 40}) + "\n"
                 for n in rng.integers(20, 600, size=2000)]
        block = "".join(lines).encode()
        with open(path, "wb") as f:
            for _ in range(max(1, megabytes * 1_000_000 // len(block))):
                f.write(block)
        size = os.path.getsize(path)
        start = time.perf_counter()
        index = JsonlIndex(path, workers=2)
        first = time.perf_counter() - start
        start = time.perf_counter()
        JsonlIndex(path)
        second = time.perf_counter() - start
        return {"mb": size / 1e6, "lines": len(index), "first_s": first, "rate_mb_s": size / 1e6 / first,
                "cached_open_ms": 1000 * second}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=2000)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--mbs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--index-mb", type=int, default=150)
    args = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as root:
        mean = write_skewed_dataset(root, args.records, args.seq)
        print(f"dataset: {args.records} records, mean length {mean:.1f} tokens, seq {args.seq}, "
              f"micro-batch {args.mbs}, {args.steps} timed steps (CPU, {torch.get_num_threads()} threads)")
        rows = [run_mode("pad to seq", root, args.seq, args.mbs, args.steps, packed=False, pad_to_max=True),
                run_mode("pad to longest", root, args.seq, args.mbs, args.steps, packed=False, pad_to_max=False),
                run_mode("packed", root, args.seq, args.mbs, args.steps, packed=True, pad_to_max=True)]
    print(f"{'mode':<16}{'step ms':>9}{'processed tok/s':>17}{'real tok/s':>12}{'loss tok/s':>12}"
          f"{'useful':>8}{'docs/s':>9}")
    for r in rows:
        print(f"{r['mode']:<16}{r['step_ms']:>9.1f}{r['processed_tok_s']:>17,.0f}{r['real_tok_s']:>12,.0f}"
              f"{r['loss_tok_s']:>12,.0f}{r['useful_fraction']:>8.1%}{r['docs_s']:>9.1f}")
    if args.index_mb > 0:
        r = bench_indexing(args.index_mb)
        print(f"JSONL index: {r['mb']:.0f} MB, {r['lines']:,} lines: first build {r['first_s']:.2f} s "
              f"({r['rate_mb_s']:,.0f} MB/s, so 1 GB in {1000 / r['rate_mb_s']:.1f} s); "
              f"cached open {r['cached_open_ms']:.1f} ms")


if __name__ == "__main__":
    main()
