"""``longspan preprocess``: documents = tokenizer ids + EOD, Megatron's output names, inputs, errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from longspan.cli import main
from longspan.data.indexed_dataset import IndexedDataset

from tests.data.test_tokenizers import _train_bpe

DOCS = [f"Document {i}. The quick brown fox jumps over the lazy dog {i * 13}.\nSecond line {i}." for i in range(120)]
DOCS[7] = ""  # an empty document stays an (empty) document


@pytest.fixture
def hf_dir(tmp_path):
    _train_bpe(tmp_path / "tok")
    return tmp_path / "tok"


@pytest.fixture
def jsonl(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"text": d, "title": f"t{i}"}) + "\n" for i, d in enumerate(DOCS)))
    return path


def _oracle(hf_dir):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(hf_dir / "tokenizer.json"))


def _run(*args):
    return main(["preprocess", "--no-progress", *map(str, args)])


def test_jsonl_documents_are_ids_plus_eod(tmp_path, hf_dir, jsonl):
    rc = _run("--input", jsonl, "--output-prefix", tmp_path / "out", "--tokenizer-type", "HuggingFaceTokenizer",
              "--tokenizer-model", hf_dir, "--append-eod", "--json-keys", "text", "title")
    assert rc == 0
    ref = _oracle(hf_dir)
    eod = ref.token_to_id("<|endoftext|>")
    for key in ("text", "title"):
        ds = IndexedDataset(str(tmp_path / f"out_{key}_document"))
        assert ds.dtype == np.uint16  # vocabulary below 65500
        assert len(ds.document_indices) == len(DOCS) + 1
        for i, doc in enumerate(DOCS):
            text = doc if key == "text" else f"t{i}"
            ids = ref.encode(text, add_special_tokens=False).ids
            beg, end = ds.document_indices[i], ds.document_indices[i + 1]
            got = [t for s in range(beg, end) for t in ds[s].tolist()]
            assert got == (ids + [eod] if ids else [])


def test_workers_and_partitions_do_not_change_the_files(tmp_path, hf_dir, jsonl):
    outs = []
    for workers, parts in ((1, 1), (2, 3)):
        prefix = tmp_path / f"o{workers}"
        assert _run("--input", jsonl, "--output-prefix", prefix, "--tokenizer-type", "HuggingFaceTokenizer",
                    "--tokenizer-model", hf_dir, "--append-eod", "--workers", workers, "--partitions", parts) == 0
        outs.append(prefix)
    for ext in (".bin", ".idx"):
        a = (tmp_path / f"o1_text_document{ext}").read_bytes()
        b = (tmp_path / f"o2_text_document{ext}").read_bytes()
        assert a == b
    assert not list(tmp_path.glob("*_part*"))


def test_plain_text_and_parquet_inputs(tmp_path, hf_dir):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    lines = [d.replace("\n", " ") for d in DOCS if d]
    (tmp_path / "in.txt").write_text("".join(line + "\n" for line in lines))
    pq.write_table(pa.table({"text": lines}), str(tmp_path / "in.parquet"))
    ref = _oracle(hf_dir)
    for name in ("in.txt", "in.parquet"):
        prefix = tmp_path / name.replace(".", "_")
        assert _run("--input", tmp_path / name, "--output-prefix", prefix, "--tokenizer-type", "HuggingFaceTokenizer",
                    "--tokenizer-model", hf_dir, "--append-eod") == 0
        ds = IndexedDataset(f"{prefix}_text_document")
        assert len(ds) == len(lines)
        assert ds[3].tolist() == ref.encode(lines[3], add_special_tokens=False).ids + [ref.token_to_id("<|endoftext|>")]


def _one_error_line(capsys):
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("longspan: error:")
    return err


def test_bad_inputs_exit_2_with_one_line(tmp_path, hf_dir, jsonl, capsys):
    common = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", hf_dir]
    assert _run("--input", tmp_path / "missing.jsonl", "--output-prefix", tmp_path / "o", *common) == 2
    assert "missing.jsonl" in _one_error_line(capsys)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{not json\n')
    assert _run("--input", bad, "--output-prefix", tmp_path / "o", *common) == 2
    assert "bad.jsonl:2" in _one_error_line(capsys)
    assert _run("--input", jsonl, "--output-prefix", tmp_path / "o", "--json-keys", "body", *common) == 2
    assert "'body'" in _one_error_line(capsys)


def test_append_eod_without_eod_token_is_an_error(tmp_path, jsonl, capsys):
    _train_bpe(tmp_path / "noeos", eos=False)
    assert _run("--input", jsonl, "--output-prefix", tmp_path / "o", "--tokenizer-type", "HuggingFaceTokenizer",
                "--tokenizer-model", tmp_path / "noeos", "--append-eod") == 2
    assert "--append-eod" in _one_error_line(capsys)


def test_split_sentences_says_what_is_missing(tmp_path, hf_dir, jsonl, capsys):
    try:
        import nltk  # noqa: F401

        pytest.skip("NLTK is installed here; the message is for machines without it")
    except ImportError:
        pass
    assert _run("--input", jsonl, "--output-prefix", tmp_path / "o", "--tokenizer-type", "HuggingFaceTokenizer",
                "--tokenizer-model", hf_dir, "--split-sentences") == 2
    assert "punkt" in _one_error_line(capsys)
