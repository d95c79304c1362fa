"""``longspan preprocess --input FILE --output-prefix PREFIX --tokenizer-type T [...]``: text -> .bin/.idx.

The options are those of Megatron's tools/preprocess_data.py; outputs are ``{prefix}_{key}_document.bin/.idx``.
"""

from __future__ import annotations

import argparse
import os
from types import SimpleNamespace
from typing import Any

from longspan.core.logging import get_logger, setup_logging

logger = get_logger(__name__)


def add_parser(subparsers: Any, name: str) -> None:
    parser = subparsers.add_parser(name, help="tokenize JSONL / text / Parquet into Megatron .bin/.idx files",
                                   description=__doc__.splitlines()[0])
    group = parser.add_argument_group("input data")
    group.add_argument("--input", required=True, help="a .jsonl/.json file, a .parquet file, or plain text (one document per line)")
    group.add_argument("--json-keys", nargs="+", default=["text"], help="JSON keys (Parquet columns) to extract")
    group.add_argument("--split-sentences", action="store_true", help="store each sentence as a sequence (needs NLTK punkt)")
    group.add_argument("--keep-newlines", action="store_true", help="keep newlines between sentences when splitting")
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", required=True,
                       help="HuggingFaceTokenizer, SentencePieceTokenizer, GPT2BPETokenizer, NullTokenizer, ByteLevelTokenizer")
    group.add_argument("--tokenizer-model", default=None, help="HF directory / tokenizer.json / .model file / builtin:stdlib")
    group.add_argument("--vocab-file", default=None, help="vocab.json (GPT2BPETokenizer)")
    group.add_argument("--merge-file", default=None, help="merges.txt (GPT2BPETokenizer)")
    group.add_argument("--vocab-size", type=int, default=None, help="vocabulary size (NullTokenizer)")
    group.add_argument("--append-eod", action="store_true", help="append the end-of-document token to each document")
    group.add_argument("--add-bos", action="store_true", help="prepend the beginning-of-sequence token to each document")
    group.add_argument("--lang", default="english", help="language of the sentence splitter")
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", required=True, help="path prefix of the output files (without _key_document)")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=_positive_int, default=1, help="tokenizer worker processes")
    group.add_argument("--partitions", type=_positive_int, default=1,
                       help="write the output in this many parts, then merge them")
    group.add_argument("--log-interval", type=_positive_float, default=2.0, help="seconds between progress lines")
    group.add_argument("--no-progress", action="store_true", help="no progress line")
    parser.set_defaults(func=run)


def _positive_int(text: str) -> int:
    """argparse type: a positive integer (a bad value is argparse's one-line error, exit 2)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be a positive integer")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{value} must be a positive number")
    return value


def run(args: argparse.Namespace) -> int:
    from longspan.data.preprocess import PreprocessOptions, preprocess

    setup_logging()
    tokenizer_config = SimpleNamespace(
        tokenizer_type=args.tokenizer_type,
        tokenizer_model=args.tokenizer_model,
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
        vocab_size=args.vocab_size,
        hf_tokenizer_kwargs=None,
    )
    options = PreprocessOptions(
        json_keys=list(args.json_keys),
        append_eod=args.append_eod,
        add_bos=args.add_bos,
        split_sentences=args.split_sentences,
        keep_newlines=args.keep_newlines,
        lang=args.lang,
    )
    workers = args.workers
    result = preprocess(args.input, args.output_prefix, tokenizer_config, options, workers=workers,
                        partitions=args.partitions, progress=not args.no_progress, log_interval=args.log_interval)
    for key, prefix in result.output_prefixes.items():
        logger.info(f"wrote {prefix}.bin / {prefix}.idx ({key})")
    cores = min(workers, os.cpu_count() or 1)
    logger.info(
        f"{result.documents} documents, {result.tokens} tokens in {result.seconds:.1f} s: "
        f"{result.tokens_per_second:,.0f} tokens/s, {result.tokens_per_second / cores:,.0f} tokens/s per core"
    )
    return 0
