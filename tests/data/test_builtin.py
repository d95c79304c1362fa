"""The shipped corpus (builtin:stdlib): prepared into a cache on first use, deterministic, readable."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

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
    tok = build_tokenizer(NS(tokenizer_type="HuggingFaceTokenizer", tokenizer_model="builtin:stdlib"))
    prefixes, weights = resolve_data_path("builtin:stdlib", tok)
    return tok, prefixes[0], weights


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
    assert len(decoded) > 32 and any(decoded in text for text in _stdlib_sources())
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
    byte_tok = build_tokenizer(NS(tokenizer_type="ByteLevelTokenizer", vocab_size=None))
    prefix = resolve_data_path("builtin:stdlib", byte_tok)[0][0]
    ds = IndexedDataset(prefix)
    assert bytes(ds[0][:-1].tolist()).decode("utf-8").startswith(("def ", "class ", "\"\"\"", "#", "import", "from"))
    with pytest.raises(DataError) as e:
        resolve_data_path("builtin:nope", byte_tok)
    assert "builtin:stdlib" in str(e.value)
