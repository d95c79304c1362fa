"""``longspan preprocess --input FILE --output-prefix PREFIX --tokenizer-type T [...]``: text -> .bin/.idx.

The options are those of Megatron's tools/preprocess_data.py; outputs are ``{prefix}_{key}_document.bin/.idx``.
``--pack-sft DIR --packed-sequence-size N`` instead packs an SFT dataset (DIR/training.jsonl, validation.jsonl)
ahead of time into the files a finetuning run with ``dataset.packed_sequence_specs`` reads (longspan.data.sft).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from longspan.core.errors import LaunchError
from longspan.core.logging import get_logger, setup_logging

logger = get_logger(__name__)


DESCRIPTION = ("Tokenize JSONL, JSON, Parquet or plain text (one document per line) into Megatron's .bin/.idx "
               "files, PREFIX_KEY_document.bin/.idx for each JSON key, with the options of Megatron's "
               "tools/preprocess_data.py. With --pack-sft DIR --packed-sequence-size N it instead packs an SFT "
               "dataset (DIR/training.jsonl and validation.jsonl) ahead of time into the files a finetuning run with "
               "dataset.packed_sequence_specs reads.")


def add_parser(subparsers: Any, name: str) -> None:
    """Register ``longspan preprocess``."""
    parser = subparsers.add_parser(name, help="tokenize JSONL / text / Parquet into Megatron .bin/.idx files",
                                   description=DESCRIPTION)
    group = parser.add_argument_group("input data")
    group.add_argument("--input", metavar="FILE", help="a .jsonl/.json file, a .parquet file, or plain text (one document per line)")
    group.add_argument("--json-keys", nargs="+", default=["text"], metavar="KEY",
                       help="JSON keys (Parquet columns) to extract (default text)")
    group.add_argument("--split-sentences", action="store_true", help="store each sentence as a sequence (needs NLTK punkt)")
    group.add_argument("--keep-newlines", action="store_true", help="keep newlines between sentences when splitting")
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", required=True, metavar="TYPE",
                       help="HuggingFaceTokenizer, SentencePieceTokenizer, GPT2BPETokenizer, NullTokenizer, ByteLevelTokenizer")
    group.add_argument("--tokenizer-model", default=None, metavar="PATH",
                       help="HF directory, tokenizer.json, SentencePiece .model file, or builtin:stdlib")
    group.add_argument("--vocab-file", default=None, metavar="FILE", help="vocab.json (GPT2BPETokenizer)")
    group.add_argument("--merge-file", default=None, metavar="FILE", help="merges.txt (GPT2BPETokenizer)")
    group.add_argument("--vocab-size", type=int, default=None, metavar="N", help="vocabulary size (NullTokenizer)")
    group.add_argument("--append-eod", action="store_true", help="append the end-of-document token to each document")
    group.add_argument("--add-bos", action="store_true", help="prepend the beginning-of-sequence token to each document")
    group.add_argument("--lang", default="english", help="language of the sentence splitter (default english)")
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", metavar="PREFIX", help="path prefix of the output files (without _KEY_document)")
    group = parser.add_argument_group("SFT packing (instead of --input/--output-prefix)")
    group.add_argument("--pack-sft", metavar="DIR", default=None,
                       help="pack DIR/training.jsonl and validation.jsonl for dataset.packed_sequence_specs")
    group.add_argument("--packed-sequence-size", type=int, default=None, metavar="N", help="tokens per pack (= model.seq_length)")
    group.add_argument("--seq-length", type=int, default=None, metavar="N", help="truncate documents to this (default: the pack size)")
    group.add_argument("--seed", type=int, default=1234, help="dataset.seed, for packing tie-breaks (default 1234)")
    group.add_argument("--dataset-kwargs", default=None, metavar="JSON", help="dataset.dataset_kwargs as JSON")
    group.add_argument("--chat-template", default=None, metavar="FILE", help="a file with the Jinja chat template (tokenizer.chat_template)")
    group.add_argument("--tokenizer-model-name", default=None, metavar="NAME", help="packed_sequence_specs.tokenizer_model_name")
    group.add_argument("--pad-seq-to-mult", type=int, default=1, metavar="N",
                       help="packed_sequence_specs.pad_seq_to_mult (default 1)")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=_positive_int, default=1, metavar="N",
                       help="tokenizer worker processes (default 1)")
    group.add_argument("--partitions", type=_positive_int, default=1, metavar="N",
                       help="write the output in this many parts, then merge them")
    group.add_argument("--log-interval", type=_positive_float, default=2.0, metavar="S",
                       help="seconds between progress bar redraws on a terminal (elsewhere: a line every 10%%)")
    group.add_argument("--no-progress", action="store_true", help="no progress bar / progress lines")
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
    # `longspan --help` must not import torch
    from longspan.config.schema.data import TokenizerConfig
    from longspan.data.preprocess import PreprocessOptions, preprocess

    setup_logging()
    if args.pack_sft is not None:
        return _pack_sft(args)
    if args.input is None or args.output_prefix is None:
        raise LaunchError("longspan preprocess needs --input and --output-prefix (or --pack-sft DIR)")
    tokenizer_config = TokenizerConfig(
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


def _pack_sft(args: argparse.Namespace) -> int:
    # `longspan --help` must not import torch
    from longspan.config.schema.data import TokenizerConfig
    from longspan.data.sft import PackedSequenceSpecs, pack_sft_dataset
    from longspan.data.tokenizers import build_tokenizer

    if not args.packed_sequence_size or args.packed_sequence_size <= 0:
        raise LaunchError("--pack-sft needs --packed-sequence-size N (a positive number of tokens, = model.seq_length)")
    try:
        dataset_kwargs = json.loads(args.dataset_kwargs) if args.dataset_kwargs else None
    except ValueError as exc:
        raise LaunchError(f"--dataset-kwargs {args.dataset_kwargs!r} is not valid JSON: {exc}") from None
    chat_template = None
    if args.chat_template:
        if not os.path.isfile(args.chat_template):
            raise LaunchError(f"--chat-template {args.chat_template} does not exist")
        with open(args.chat_template) as f:
            chat_template = f.read()
    tokenizer = build_tokenizer(TokenizerConfig(
        tokenizer_type=args.tokenizer_type, tokenizer_model=args.tokenizer_model, vocab_file=args.vocab_file,
        merge_file=args.merge_file, vocab_size=args.vocab_size, hf_tokenizer_kwargs=None))
    specs = PackedSequenceSpecs(packed_sequence_size=args.packed_sequence_size,
                                tokenizer_model_name=args.tokenizer_model_name, pad_seq_to_mult=args.pad_seq_to_mult)
    for path, meta in pack_sft_dataset(args.pack_sft, tokenizer, specs, args.seq_length, args.seed, dataset_kwargs,
                                       chat_template, max(1, args.workers)):
        logger.info(f"{path}: {meta['num_documents']} documents in {meta['num_packs']} packs of "
                    f"{meta['packed_sequence_size']} tokens, {meta['useful_token_fraction']:.1%} useful")
    return 0
