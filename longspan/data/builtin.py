"""The corpus that ships: Python's own standard library, prepared on first use (``builtin:stdlib``).

Every machine with Python has its standard library, so a quickstart can train on real text with no download.
A deterministic subset (top-level ``.py`` modules in sorted order, about 3 MB, cut into documents at top-level
``def``/``class`` lines) is tokenized into a ``.bin``/``.idx`` pair. ``builtin:stdlib`` as a tokenizer model
(HuggingFaceTokenizer) is a byte-level BPE with 4096 tokens trained on that text with the ``tokenizers`` library.

Files differ between Python builds, so the cache (``$LONGSPAN_CACHE`` or ``~/.cache/longspan``) is keyed on a
hash of the text (and, for the token files, of the tokenizer). One process prepares while the others wait: a
file lock between processes, and with torch.distributed up, rank 0 first and a barrier.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import sysconfig
import tempfile
from typing import Any, Iterator, List, Tuple

import numpy as np
import torch.distributed as dist
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from longspan.core.errors import DataError
from longspan.core.logging import get_logger
from longspan.data.indexed_dataset import DType, IndexedDatasetBuilder

logger = get_logger(__name__)

BUILTIN_CORPORA = ("stdlib",)
CORPUS_BYTES = 3_000_000
BPE_VOCAB_SIZE = 4096
_RECIPE_VERSION = "stdlib-v2"  # bump when the selection or the tokenizer training changes
# Documents are packed to comparable sizes: about TARGET_DOCUMENTS of them, none under MIN_DOCUMENT_BYTES, so
# every split of '969,30,1' holds whole documents of whole training samples on every Python version.
TARGET_DOCUMENTS = 2000
MIN_DOCUMENT_BYTES = 1024
_SPLIT_RE = re.compile(r"(?m)^(?=(?:def |class |async def ))")


def cache_root() -> str:
    """``$LONGSPAN_CACHE`` or ``~/.cache/longspan``."""
    return os.environ.get("LONGSPAN_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "longspan")


def _corpus_name(spec: str) -> str:
    name = spec.split(":", 1)[1] if spec.startswith("builtin:") else spec
    if name not in BUILTIN_CORPORA:
        raise DataError(f"builtin corpus {spec!r} does not exist; valid: {', '.join('builtin:' + c for c in BUILTIN_CORPORA)}")
    return name


def stdlib_documents(max_bytes: int = CORPUS_BYTES) -> List[str]:
    """The documents of the stdlib corpus: top-level modules in sorted order, split at top-level definitions."""
    root = sysconfig.get_paths()["stdlib"]
    try:
        names = sorted(n for n in os.listdir(root) if n.endswith(".py") and not n.startswith(("_", "test")))
    except OSError as exc:
        raise DataError(f"cannot list the Python standard library at {root}: {exc.strerror}") from None
    docs: List[str] = []
    total = 0
    for name in names:
        try:
            with open(os.path.join(root, name), encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError):
            continue
        for piece in _SPLIT_RE.split(text):
            piece = piece.strip("\n")
            if len(piece) < 32:
                continue
            docs.append(piece + "\n")
            total += len(piece) + 1
        if total >= max_bytes:
            break
    if not docs:
        raise DataError(f"the Python standard library at {root} has no readable .py modules to build builtin:stdlib from")
    return pack_documents(docs)


def _pieces_of_at_most(piece: str, limit: int) -> List[str]:
    """``piece`` cut at line ends (a line longer than ``limit`` at characters) into parts of <= ~``limit``."""
    parts: List[str] = []
    current = ""
    for line in piece.splitlines(keepends=True):
        while len(line) > limit:
            parts.append(current + line[:limit]) if current else parts.append(line[:limit])
            current, line = "", line[limit:]
        if current and len(current) + len(line) > limit:
            parts.append(current)
            current = ""
        current += line
    if current:
        parts.append(current)
    return parts


def pack_documents(pieces: List[str], target_documents: int = TARGET_DOCUMENTS) -> List[str]:
    """Regroup pieces into about ``target_documents`` documents of comparable size, order and text kept.

    Splits like '969,30,1' count documents (Megatron's semantics), so documents of very different sizes give
    splits of very different token counts: Python 3.12's stdlib once left the test split 2 tiny documents
    (60 tokens, less than one sample). Here every document holds at least ``total / target_documents`` bytes
    (>= MIN_DOCUMENT_BYTES) and at most about three times that, so there are between a third of
    ``target_documents`` and ``target_documents`` of them: the 1/1000 split is at least one document of
    >= 1.5 KB (about 400 tokens) for the ~3 MB corpus, whatever the Python version's files look like.
    """
    total = sum(len(p) for p in pieces)
    target = max(MIN_DOCUMENT_BYTES, total // max(1, target_documents))
    parts: List[str] = []
    for piece in pieces:
        parts.extend(_pieces_of_at_most(piece, 2 * target) if len(piece) > 2 * target else [piece])
    docs: List[str] = []
    current: List[str] = []
    size = 0
    for part in parts:
        current.append(part)
        size += len(part)
        if size >= target:
            docs.append("".join(current))
            current, size = [], 0
    if current:
        if docs:
            docs[-1] += "".join(current)
        else:
            docs.append("".join(current))
    return docs


def _content_hash(docs: List[str]) -> str:
    h = hashlib.sha256(_RECIPE_VERSION.encode())
    for d in docs:
        h.update(d.encode("utf-8"))
        h.update(b"\x00")
    return h.hexdigest()[:16]


@contextlib.contextmanager
def _file_lock(path: str) -> Iterator[None]:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _rank0_first(prepare) -> Any:
    """Run ``prepare`` on rank 0, barrier, then on the other ranks (a cache hit there)."""
    if not (dist.is_available() and dist.is_initialized()):
        return prepare()
    result, error = None, None
    if dist.get_rank() == 0:
        try:
            result = prepare()
        except BaseException as exc:
            error = exc
    dist.barrier()
    if error is not None:
        raise error
    if dist.get_rank() != 0:
        result = prepare()
    return result


def _publish(tmp_dir: str, final_dir: str) -> None:
    if os.path.isdir(final_dir):
        shutil.rmtree(final_dir)
    os.replace(tmp_dir, final_dir)


def _train_tokenizer(docs: List[str], out_dir: str) -> None:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        special_tokens=["<|endoftext|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|endoftext|>", "pad_token": "<|pad|>", "bos_token": None,
                   "tokenizer_class": "PreTrainedTokenizerFast", "source": "longspan builtin:stdlib"}, f, indent=2)


def builtin_tokenizer_dir(spec: str = "builtin:stdlib") -> str:
    """Directory of the BPE tokenizer trained on a builtin corpus (trained and cached on first use)."""
    name = _corpus_name(spec)
    docs = stdlib_documents()
    key = _content_hash(docs)
    base = os.path.join(cache_root(), "builtin", f"{name}-{key}")
    final = os.path.join(base, "tokenizer")

    def prepare() -> str:
        if os.path.isfile(os.path.join(final, "tokenizer.json")):
            return final
        with _file_lock(os.path.join(base, ".lock")):
            if os.path.isfile(os.path.join(final, "tokenizer.json")):
                return final
            logger.info(f"Training the builtin:{name} BPE tokenizer ({BPE_VOCAB_SIZE} tokens) into {final}")
            tmp = tempfile.mkdtemp(dir=base, prefix=".tokenizer-")
            _train_tokenizer(docs, tmp)
            _publish(tmp, final)
        return final

    return _rank0_first(prepare)


def _tokenizer_fingerprint(tokenizer: Any, docs: List[str]) -> str:
    """Identity of a tokenizer by its behaviour: ids of a probe text plus its special ids."""
    probe = "".join(docs[:20])[:20000]
    h = hashlib.sha256(type(tokenizer).__name__.encode())
    h.update(json.dumps([tokenizer.vocab_size, tokenizer.eod]).encode())
    h.update(np.asarray(tokenizer.tokenize(probe), dtype=np.int64).tobytes())
    return h.hexdigest()[:16]


def _write_corpus(docs: List[str], tokenizer: Any, prefix: str) -> Tuple[int, int]:
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    batch = getattr(tokenizer, "tokenize_batch", None)
    encoded = batch(docs) if batch is not None else [tokenizer.tokenize(d) for d in docs]
    tokens = 0
    for ids in encoded:
        ids = list(ids) + [tokenizer.eod]
        builder.add_item(np.asarray(ids, dtype=np.int64))
        builder.end_document()
        tokens += len(ids)
    builder.finalize(prefix + ".idx")
    return len(encoded), tokens


def prepare_builtin_corpus(spec: str, tokenizer: Any) -> str:
    """Path prefix of a builtin corpus tokenized with ``tokenizer`` (prepared and cached on first use)."""
    name = _corpus_name(spec)
    if getattr(tokenizer, "eod", None) is None:
        raise DataError(f"{spec} needs a tokenizer with an end-of-document token; {type(tokenizer).__name__} has none")
    docs = stdlib_documents()
    key = _content_hash(docs)
    base = os.path.join(cache_root(), "builtin", f"{name}-{key}")
    final = os.path.join(base, f"data-{_tokenizer_fingerprint(tokenizer, docs)}")
    prefix = os.path.join(final, f"{name}_text_document")

    def prepare() -> str:
        if os.path.isfile(prefix + ".idx"):
            return prefix
        with _file_lock(os.path.join(base, ".lock")):
            if os.path.isfile(prefix + ".idx"):
                return prefix
            tmp = tempfile.mkdtemp(dir=base, prefix=".data-")
            n_docs, n_tokens = _write_corpus(docs, tokenizer, os.path.join(tmp, f"{name}_text_document"))
            _publish(tmp, final)
            logger.info(f"Prepared builtin:{name}: {n_docs} documents, {n_tokens} tokens in {final}")
        return prefix

    return _rank0_first(prepare)
