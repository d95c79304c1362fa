"""Text (JSONL, plain text, Parquet) -> Megatron ``.bin``/``.idx`` files, as Megatron's preprocess_data.py.

Outputs are ``{output_prefix}_{key}_document.bin/.idx`` (``_sentence`` with sentence splitting), one per JSON
key. A document's ids are the tokenizer's encoding without added special tokens (BOS first with
``add_bos``; EOD last with ``append_eod``). Worker processes tokenize chunks of documents in order, so the
output does not depend on the number of workers or partitions.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from longspan.config.schema.data import TokenizerConfig
from longspan.core.errors import DataError, LongspanError
from longspan.core.logging import get_logger
from longspan.core.progress import Progress
from longspan.data.indexed_dataset import DType, IndexedDatasetBuilder, get_bin_path, get_idx_path
from longspan.data.tokenizers import build_tokenizer

logger = get_logger(__name__)

CHUNK_DOCS = 64  # documents per worker task: large enough to amortize inter-process traffic


@dataclass
class PreprocessOptions:
    """What to do with each document (Megatron preprocess_data.py's options)."""

    json_keys: Sequence[str] = ("text",)
    """JSON fields (Parquet columns) to tokenize; each gets its own output files."""
    append_eod: bool = False
    """Append the tokenizer's end-of-document id to each document."""
    add_bos: bool = False
    """Prepend the tokenizer's beginning-of-sequence id to each document."""
    split_sentences: bool = False
    """Store each sentence as its own sequence (needs NLTK's punkt data)."""
    keep_newlines: bool = False
    """With split_sentences, keep newlines between sentences."""
    lang: str = "english"
    """Language of NLTK's sentence splitter."""


@dataclass
class PreprocessResult:
    """What preprocessing wrote and how fast."""

    output_prefixes: Dict[str, str]
    documents: int = 0
    tokens: int = 0
    seconds: float = 0.0
    workers: int = 1
    input_bytes: int = 0
    extra: Dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def output_prefix_for(output_prefix: str, key: str, split_sentences: bool) -> str:
    """``{output_prefix}_{key}_document`` (``_sentence`` with sentence splitting)."""
    return f"{output_prefix}_{key}_{'sentence' if split_sentences else 'document'}"


# ---------------------------------------------------------------------------------------------- reading
def input_format(path: str) -> str:
    """'jsonl', 'text' or 'parquet', from the file name."""
    lower = path.lower()
    if lower.endswith(".parquet"):
        return "parquet"
    if lower.endswith((".jsonl", ".json", ".jsonl.txt", ".ndjson")):
        return "jsonl"
    return "text"


def iter_located_documents(path: str, json_keys: Sequence[str]) -> Iterator[Tuple[Dict[str, str], int, int]]:
    """(``{key: text}``, bytes or rows read so far, line number or row) for each document of the input file."""
    if not os.path.isfile(path):
        raise DataError(f"input file {path} does not exist")
    fmt = input_format(path)
    if fmt == "parquet":
        try:
            import pyarrow.parquet as pq  # optional dependency: only Parquet inputs need it
        except ImportError:
            raise DataError("reading Parquet needs the pyarrow package (pip install pyarrow)") from None
        try:
            pfile = pq.ParquetFile(path)
        except Exception as exc:
            raise DataError(f"cannot read Parquet file {path}: {exc}") from None
        missing = [k for k in json_keys if k not in pfile.schema_arrow.names]
        if missing:
            raise DataError(f"{path} has no column {missing[0]!r}; columns: {', '.join(pfile.schema_arrow.names)}")
        rows = 0
        for batch in pfile.iter_batches(columns=list(json_keys)):
            cols = {k: batch.column(k).to_pylist() for k in json_keys}
            for i in range(batch.num_rows):
                rows += 1
                yield {k: "" if cols[k][i] is None else str(cols[k][i]) for k in json_keys}, rows, rows
        return
    done = 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            done += len(raw)
            if fmt == "text":
                text = raw.decode("utf-8", errors="replace").rstrip("\n")
                yield {k: text for k in json_keys}, done, lineno
                continue
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{lineno} is not valid JSON ({exc.msg})") from None
            if not isinstance(record, dict):
                raise DataError(f"{path}:{lineno} is not a JSON object")
            try:
                yield {k: str(record[k]) for k in json_keys}, done, lineno
            except KeyError as exc:
                raise DataError(f"{path}:{lineno} has no key {exc.args[0]!r} (--json-keys {' '.join(json_keys)})") from None


def input_size(path: str) -> int:
    """Total bytes (rows for Parquet) of the input, for the ETA."""
    if input_format(path) == "parquet":
        import pyarrow.parquet as pq  # optional dependency: only Parquet inputs need it

        return int(pq.ParquetFile(path).metadata.num_rows)
    return os.path.getsize(path)


# ------------------------------------------------------------------------------------------- tokenizing
_WORKER: Dict[str, Any] = {}


def _sentence_splitter(lang: str, keep_newlines: bool):
    try:
        import nltk  # optional dependency: only --split-sentences needs it
    except ImportError:
        raise DataError("--split-sentences needs NLTK and its punkt data: pip install nltk && python -m nltk.downloader punkt") from None
    try:
        splitter = nltk.load(f"tokenizers/punkt/{lang}.pickle")
    except LookupError:
        try:
            from nltk.tokenize import PunktTokenizer  # optional dependency (see above); newer NLTK's punkt_tab

            splitter = PunktTokenizer(lang)
        except Exception:
            raise DataError(
                f"--split-sentences needs NLTK's punkt data for {lang!r}, which is missing: "
                f"python -m nltk.downloader punkt punkt_tab"
            ) from None
    return splitter


def _split(splitter: Any, text: str, keep_newlines: bool) -> List[str]:
    """Sentences of ``text``; with keep_newlines each keeps the whitespace (newlines) that follows it."""
    if not keep_newlines:
        return splitter.tokenize(text)
    spans = list(splitter.span_tokenize(text))
    return [text[start : spans[i + 1][0] if i + 1 < len(spans) else len(text)] for i, (start, _) in enumerate(spans)]


def _init_worker(tokenizer_config: TokenizerConfig, options: PreprocessOptions, input_path: str = "") -> None:
    _WORKER["tokenizer"] = build_tokenizer(tokenizer_config)
    _WORKER["input_path"] = input_path
    _WORKER["options"] = options
    _WORKER["splitter"] = _sentence_splitter(options.lang, options.keep_newlines) if options.split_sentences else None


def _encode_documents(chunk: Tuple[List[Dict[str, str]], List[int]]) -> List[Dict[str, Tuple[List[int], List[int]]]]:
    """For each document of a chunk (documents, their line numbers or rows) and key: (token ids, sequence
    lengths)."""
    docs, locations = chunk
    tok = _WORKER["tokenizer"]
    opts: PreprocessOptions = _WORKER["options"]
    splitter = _WORKER["splitter"]
    out: List[Dict[str, Tuple[List[int], List[int]]]] = [{} for _ in docs]
    for key in opts.json_keys:
        texts = [d[key] for d in docs]
        if splitter is None:
            pieces = [[ids] if len(ids) else [] for ids in _tokenize_texts(tok, texts, locations, key)]
        else:
            pieces = []
            for t, where in zip(texts, locations):
                sents = [_tokenize_one(tok, s, where, key) for s in _split(splitter, t, opts.keep_newlines)]
                pieces.append([s for s in sents if len(s)])
        for i, seqs in enumerate(pieces):
            if opts.add_bos and seqs:
                seqs[0] = [tok.bos] + list(seqs[0])
            if opts.append_eod and seqs:
                seqs[-1] = list(seqs[-1]) + [tok.eod]
            ids = [t for s in seqs for t in s]
            out[i][key] = (ids, [len(s) for s in seqs])
    return out


def _tokenize_texts(tok: Any, texts: List[str], locations: List[int], key: str) -> List[Any]:
    """The texts' ids, batched when the tokenizer can; a text it rejects is named by file and line."""
    batch = getattr(tok, "tokenize_batch", None)
    try:
        return batch(texts) if batch is not None else [tok.tokenize(t) for t in texts]
    except (ValueError, LongspanError):
        # find the document at fault (the batch call does not say which one)
        return [_tokenize_one(tok, t, where, key) for t, where in zip(texts, locations)]


def _tokenize_one(tok: Any, text: str, where: int, key: str) -> Any:
    try:
        return tok.tokenize(text)
    except (ValueError, LongspanError) as exc:
        path = _WORKER.get("input_path", "")
        place = f"{path} row {where}" if input_format(path) == "parquet" else f"{path}:{where}"
        raise DataError(f"{place} (key {key!r}): {exc}") from None


def _chunks(docs: Iterator[Tuple[Dict[str, str], int, int]],
            progress: List[int]) -> Iterator[Tuple[List[Dict[str, str]], List[int]]]:
    chunk: List[Dict[str, str]] = []
    locations: List[int] = []
    for doc, done, where in docs:
        progress[0] = done
        chunk.append(doc)
        locations.append(where)
        if len(chunk) == CHUNK_DOCS:
            yield chunk, locations
            chunk, locations = [], []
    if chunk:
        yield chunk, locations


def _progress_detail(docs: int, tokens: int, elapsed: float, workers: int) -> str:
    """Preprocessing's own counters for a progress report: documents, tokens, tokens/s overall and per core."""
    rate = tokens / max(elapsed, 1e-9)
    return f"{docs} documents | {tokens} tokens | {rate:,.0f} tokens/s ({rate / workers:,.0f}/core)"


def preprocess(
    input_path: str,
    output_prefix: str,
    tokenizer_config: TokenizerConfig,
    options: Optional[PreprocessOptions] = None,
    workers: int = 1,
    partitions: int = 1,
    progress: bool = True,
    log_interval: float = 2.0,
) -> PreprocessResult:
    """Tokenize ``input_path`` into one ``.bin``/``.idx`` pair per JSON key.

    ``partitions`` > 1 splits the work into that many contiguous parts written separately and merged in
    order (Megatron's option, for inputs too large for one pass); the files are the same either way.
    """
    options = options or PreprocessOptions()
    tokenizer = build_tokenizer(tokenizer_config)
    _check_inputs(input_path, output_prefix, tokenizer, options)
    prefixes = {k: output_prefix_for(output_prefix, k, options.split_sentences) for k in options.json_keys}
    workers = max(1, int(workers))
    t0 = time.time()
    total = input_size(input_path)
    unit = "rows" if input_format(input_path) == "parquet" else "bytes"
    writer = _PartitionedWriter(prefixes, max(1, int(partitions)), DType.optimal_dtype(tokenizer.vocab_size), total)
    docs = tokens = 0
    # a bar redrawn every log_interval seconds on a terminal, a line every 10% of the input elsewhere
    meter = Progress(total, "preprocess", unit, enabled=progress, refresh_s=log_interval)
    position = [0]
    try:
        with _encoded_chunks(input_path, tokenizer_config, options, workers, position) as results:
            for encoded in results:
                for doc in encoded:
                    tokens += writer.add(doc)
                    docs += 1
                writer.advance_to(position[0])
                meter.update(position[0], _progress_detail(docs, tokens, time.time() - t0, workers))
        writer.finish()
    except BaseException:
        # a half-written .bin/.idx would look like a dataset to the next run
        writer.remove_outputs()
        meter.close()  # the error goes on its own line, after the progress line
        raise
    meter.update(total, _progress_detail(docs, tokens, time.time() - t0, workers))
    meter.close(_progress_detail(docs, tokens, time.time() - t0, workers))
    return PreprocessResult(prefixes, docs, tokens, time.time() - t0, workers, os.path.getsize(input_path))


def _check_inputs(input_path: str, output_prefix: str, tokenizer: Any, options: PreprocessOptions) -> None:
    """One-line DataErrors for options the tokenizer cannot honour, a missing input or output directory."""
    if options.append_eod and tokenizer.eod is None:
        raise DataError(f"--append-eod: the {type(tokenizer).__name__} tokenizer has no end-of-document token")
    if options.add_bos and tokenizer.bos is None:
        raise DataError(f"--add-bos: the {type(tokenizer).__name__} tokenizer has no beginning-of-sequence token")
    if options.split_sentences:
        _sentence_splitter(options.lang, options.keep_newlines)  # fail early with a clear message
    if not os.path.isfile(input_path):
        raise DataError(f"input file {input_path} does not exist")
    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    if not os.path.isdir(out_dir):
        raise DataError(f"output directory {out_dir} does not exist (from --output-prefix {output_prefix})")


@contextlib.contextmanager
def _encoded_chunks(input_path: str, tokenizer_config: TokenizerConfig, options: PreprocessOptions, workers: int,
                    position: List[int]) -> Iterator[Iterator[List[Dict[str, Tuple[List[int], List[int]]]]]]:
    """The encoded chunks of documents in input order (``workers`` processes when > 1); ``position[0]`` follows
    the input position of the last chunk read."""
    chunks = _chunks(iter_located_documents(input_path, options.json_keys), position)
    if workers == 1:
        _init_worker(tokenizer_config, options, input_path)
        yield map(_encode_documents, chunks)
        return
    ctx = multiprocessing.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    pool = ctx.Pool(workers, initializer=_init_worker, initargs=(tokenizer_config, options, input_path))
    try:
        yield pool.imap(_encode_documents, chunks, 4)
    finally:
        pool.terminate()
        pool.join()


class _PartitionedWriter:
    """One ``IndexedDatasetBuilder`` per key for the current partition of the input; with several partitions
    each is written to ``{prefix}_part{i}`` and the parts are merged in order by ``finish``."""

    def __init__(self, prefixes: Dict[str, str], partitions: int, dtype: Any, total: int) -> None:
        self.prefixes, self.partitions, self.dtype = prefixes, partitions, dtype
        self.part_prefixes = (
            [{k: f"{p}_part{i}" for k, p in prefixes.items()} for i in range(partitions)]
            if partitions > 1 else [prefixes]
        )
        self.bounds = np.linspace(0, total, partitions + 1)
        self.part = 0
        self.builders: Dict[str, IndexedDatasetBuilder] = {}
        self.written: List[str] = []
        self._open(0)

    def _open(self, i: int) -> None:
        self.builders = {}
        for k, p in self.part_prefixes[i].items():
            self.written += [get_bin_path(p), get_idx_path(p)]
            self.builders[k] = IndexedDatasetBuilder(get_bin_path(p), dtype=self.dtype)

    def remove_outputs(self) -> None:
        """Close and delete every file this writer created (parts and final outputs)."""
        for builder in self.builders.values():
            with contextlib.suppress(Exception):
                builder.data_file.close()
        for path in dict.fromkeys(self.written):
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)

    def _close(self, i: int) -> None:
        for k, builder in self.builders.items():
            builder.finalize(get_idx_path(self.part_prefixes[i][k]))

    def add(self, doc: Dict[str, Tuple[List[int], List[int]]]) -> int:
        """Append one encoded document (every key); returns its token count."""
        tokens = 0
        for k, (ids, lengths) in doc.items():
            self.builders[k].add_document(np.asarray(ids, dtype=np.int64), lengths)
            tokens += len(ids)
        return tokens

    def advance_to(self, done_units: int) -> None:
        """Partition boundaries fall between chunks, at the input position they were meant to split."""
        while self.part + 1 < self.partitions and done_units >= self.bounds[self.part + 1]:
            self._close(self.part)
            self.part += 1
            self._open(self.part)

    def finish(self) -> None:
        """Finalize the open part and the parts that received no documents, then merge the parts in order."""
        self._close(self.part)
        for i in range(self.part + 1, self.partitions):
            self._open(i)
            self._close(i)
        if self.partitions == 1:
            return
        for k, final in self.prefixes.items():
            self.written += [get_bin_path(final), get_idx_path(final)]
            merged = IndexedDatasetBuilder(get_bin_path(final), dtype=self.dtype)
            for i in range(self.partitions):
                merged.add_index(self.part_prefixes[i][k])
            merged.finalize(get_idx_path(final))
            for i in range(self.partitions):
                for path in (get_bin_path(self.part_prefixes[i][k]), get_idx_path(self.part_prefixes[i][k])):
                    os.remove(path)
