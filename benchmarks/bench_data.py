"""Data-layer benchmarks: GPT index building at 10B tokens, and preprocessing throughput per core.

    PYTHONPATH=. python benchmarks/bench_data.py [--tokens 1e10] [--seq 4096] [--preprocess-mb 8]

Index building works from sequence lengths alone (a synthetic low-level dataset), so no 10B-token file is
written: it times the document, sample and shuffle indices of a GPTDataset that covers every token once, and
a two-way blend over it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from types import SimpleNamespace as NS

import numpy as np

# One thread inside the tokenizers library, so that tokens/s per core means one core per worker.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from longspan.data.gpt_dataset import GPTDataset
from longspan.data.indices import build_blending_indices
from longspan.data.utils import Split


class _LengthsOnly:
    """A low-level dataset that has sequence lengths and no tokens."""

    def __init__(self, lengths: np.ndarray) -> None:
        self.sequence_lengths = lengths


def bench_index(tokens: float, seq: int, mean_doc: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    n_docs = int(tokens // mean_doc)
    lengths = rng.integers(1, 2 * mean_doc, size=n_docs, dtype=np.int32)
    total = int(lengths.sum(dtype=np.int64))
    cfg = NS(random_seed=1234, sequence_length=seq, split="100,0,0", path_to_cache=None, tokenizer=None,
             add_extra_token_to_sequence=True, reset_position_ids=False, reset_attention_mask=False,
             eod_mask_loss=False, drop_last_partial_validation_sequence=True)
    num_samples = (total - 1) // seq
    t0 = time.time()
    ds = GPTDataset(_LengthsOnly(lengths), None, np.arange(n_docs, dtype=np.int32), num_samples, Split.train, cfg)
    t_gpt = time.time() - t0
    t0 = time.time()
    build_blending_indices(np.array([0.3, 0.7]), len(ds))
    t_blend = time.time() - t0
    return {"tokens": total, "documents": n_docs, "sequence_length": seq, "samples": len(ds),
            "gpt_index_seconds": round(t_gpt, 2), "two_way_blend_index_seconds": round(t_blend, 2)}


def bench_preprocess(megabytes: float, workers: int) -> dict:
    from longspan.data.preprocess import PreprocessOptions, preprocess
    from longspan.data.tokenizers import build_tokenizer

    tok_cfg = NS(tokenizer_type="HuggingFaceTokenizer", tokenizer_model="builtin:stdlib", hf_tokenizer_kwargs=None)
    build_tokenizer(tok_cfg)  # prepare the builtin BPE outside the timing
    from longspan.data.builtin import stdlib_documents

    docs = stdlib_documents()
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "in.jsonl")
        written = 0
        with open(path, "w") as f:
            while written < megabytes * 1e6:
                for d in docs:
                    line = json.dumps({"text": d}) + "\n"
                    f.write(line)
                    written += len(line)
                    if written >= megabytes * 1e6:
                        break
        for w in sorted({1, workers}):
            res = preprocess(path, os.path.join(tmp, f"out{w}"), tok_cfg, PreprocessOptions(append_eod=True),
                             workers=w, progress=False)
            cores = min(w, os.cpu_count() or 1)
            out[f"workers={w}"] = {"tokens": res.tokens, "seconds": round(res.seconds, 2),
                                   "tokens_per_s": round(res.tokens_per_second),
                                   "tokens_per_s_per_core": round(res.tokens_per_second / cores)}
    return {"input_mb": megabytes, **out}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=float, default=1e10)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--mean-doc", type=int, default=1000, help="mean document length in tokens")
    parser.add_argument("--preprocess-mb", type=float, default=8.0)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    result = {"index": bench_index(args.tokens, args.seq, args.mean_doc),
              "preprocess": bench_preprocess(args.preprocess_mb, args.workers)}
    json.dump(result, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
