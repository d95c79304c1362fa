"""The shipped corpus (builtin:stdlib): prepared into a cache on first use, deterministic, readable."""

from __future__ import annotations

import pytest

from longspan.config.schema.data import TokenizerConfig
from longspan.core.errors import DataError
from longspan.data.indexed_dataset import IndexedDataset
from longspan.data.loaders import resolve_data_path
from longspan.data.tokenizers import build_tokenizer


def _stdlib_sources():
    import os
    import sysconfig

    root = sysconfig.get_paths()["stdlib"]
    for name in sorted(os.listdir(root)):
        if name.endswith(".py"):
            with open(os.path.join(root, name), encoding="utf-8", errors="replace") as f:
                yield f.read()


def _prepare(cache, monkeypatch):
    monkeypatch.setenv("LONGSPAN_CACHE", str(cache))
    tok = build_tokenizer(TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model="builtin:stdlib"))
    prefixes, weights = resolve_data_path("builtin:stdlib", tok)
    return tok, prefixes[0], weights


@pytest.mark.slow
def test_builtin_stdlib_is_deterministic_and_cached(tmp_path, monkeypatch):
    tok, prefix, weights = _prepare(tmp_path / "a", monkeypatch)
    assert weights is None and prefix.startswith(str(tmp_path / "a"))
    assert tok.vocab_size == 4096 and tok.eod is not None
    ds = IndexedDataset(prefix)
    assert int(ds.sequence_lengths.sum()) > 200_000
    # every document ends with EOD and decodes back to Python source
    for i in (0, len(ds) // 2, len(ds) - 1):
        assert ds[i][-1] == tok.eod
    decoded = tok.detokenize(ds[len(ds) // 2][:-1].tolist()).strip()
    # a document packs consecutive pieces (each >= 32 characters of one module's source)
    assert len(decoded) > 32 and any(decoded[:32] in text for text in _stdlib_sources())
    # a second cache built from scratch holds the same bytes; a second call reuses the first cache
    _, prefix_b, _ = _prepare(tmp_path / "b", monkeypatch)
    for ext in (".bin", ".idx"):
        assert open(prefix + ext, "rb").read() == open(prefix_b + ext, "rb").read()
    import os

    mtime = os.stat(prefix_b + ".idx").st_mtime_ns
    _, again, _ = _prepare(tmp_path / "b", monkeypatch)
    assert again == prefix_b and os.stat(prefix_b + ".idx").st_mtime_ns == mtime


def test_builtin_with_byte_tokenizer_and_unknown_name(tmp_path, monkeypatch):
    monkeypatch.setenv("LONGSPAN_CACHE", str(tmp_path))
    byte_tok = build_tokenizer(TokenizerConfig(tokenizer_type="ByteLevelTokenizer", vocab_size=None))
    prefix = resolve_data_path("builtin:stdlib", byte_tok)[0][0]
    ds = IndexedDataset(prefix)
    assert bytes(ds[0][:-1].tolist()).decode("utf-8").startswith(("def ", "class ", "\"\"\"", "#", "import", "from"))
    with pytest.raises(DataError) as e:
        resolve_data_path("builtin:nope", byte_tok)
    assert "builtin:stdlib" in str(e.value)


def _split_bytes(docs, split="969,30,1"):
    from longspan.data.utils import parse_split, split_bounds, split_matrix

    out = []
    for bookend in split_matrix(parse_split(split)):
        lo, hi = split_bounds(bookend, len(docs))
        out.append(sum(len(d.encode("utf-8")) for d in docs[lo:hi]))
    return out


@pytest.mark.parametrize("name,pieces", [
    # Python 3.12's stdlib once gave 1742 pieces whose last ones were tiny: the test split had 60 tokens
    ("3.12-like", [("x" * 2000 if i < 1700 else "y" * 40) for i in range(1742)]),
    ("many small pieces", ["z" * 40] * 60000),
    ("few large pieces", ["w = 1\n" * 15000] * 34),
    ("one huge line", ["u" * 3_000_000]),
    ("uneven", [("v" * (37 + (i * 7919) % 20000) + "\n") * 2 for i in range(400)]),
])
def test_builtin_splits_hold_samples_for_any_python_version(name, pieces):
    """Documents are packed to comparable sizes, so each '969,30,1' split of a ~3 MB corpus holds at least
    one tokens_per_sample = 257 sample (at <= 4 bytes per token) whatever the pieces look like."""
    from longspan.data.builtin import MIN_DOCUMENT_BYTES, pack_documents

    docs = pack_documents(pieces)
    assert "".join(docs) == "".join(pieces)  # nothing lost, order kept
    assert all(len(d) >= MIN_DOCUMENT_BYTES for d in docs)
    assert all(size >= 4 * 257 for size in _split_bytes(docs)), (name, len(docs), _split_bytes(docs))
    assert 500 <= len(docs) <= 2000


def test_builtin_stdlib_documents_are_packed():
    from longspan.data.builtin import MIN_DOCUMENT_BYTES, stdlib_documents

    docs = stdlib_documents()
    assert all(len(d.encode("utf-8")) >= MIN_DOCUMENT_BYTES for d in docs)
    assert min(_split_bytes(docs)) >= 4 * 257
