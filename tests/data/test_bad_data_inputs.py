"""Bad data met in the first hour: one line naming the file and line, exit 2, no traceback, nothing left behind."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from longspan.cli import main
from tests.helpers.cli_errors import assert_one_line


@pytest.mark.parametrize("workers,partitions", [(1, 1), (2, 1), (1, 3)])
def test_null_tokenizer_on_words_names_the_line_and_leaves_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture, workers: int, partitions: int
) -> None:
    lines = ['{"text": "%d %d 3"}' % (i % 7, i % 5) for i in range(300)]
    lines[200] = '{"text": "hello world"}'
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    out.mkdir()
    code = main(["preprocess", "--input", str(tmp_path / "in.jsonl"), "--output-prefix", str(out / "data"),
                 "--tokenizer-type", "NullTokenizer", "--vocab-size", "16", "--no-progress",
                 "--workers", str(workers), "--partitions", str(partitions)])
    assert_one_line(code, capsys.readouterr().err,
                     f"{tmp_path / 'in.jsonl'}:201 (key 'text'): NullTokenizer expects space-separated integer "
                     "token ids, got 'hello'")
    assert list(out.iterdir()) == []


def test_null_tokenizer_on_plain_text_names_the_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "in.txt").write_text("1 2 3\n4 5\nThe quick brown fox\n")
    code = main(["preprocess", "--input", str(tmp_path / "in.txt"), "--output-prefix", str(tmp_path / "data"),
                 "--tokenizer-type", "NullTokenizer", "--vocab-size", "16", "--append-eod"])
    assert_one_line(code, capsys.readouterr().err, f"{tmp_path / 'in.txt'}:3 (key 'text'): NullTokenizer expects")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt"]


def test_bad_json_line_mid_preprocess_removes_partial_outputs(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    lines = ['{"text": "1 2 3"}'] * 500 + ["{not json"]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    code = main(["preprocess", "--input", str(tmp_path / "in.jsonl"), "--output-prefix", str(tmp_path / "data"),
                 "--tokenizer-type", "NullTokenizer", "--vocab-size", "16", "--no-progress"])
    assert_one_line(code, capsys.readouterr().err, f"{tmp_path / 'in.jsonl'}:501 is not valid JSON")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


# --- SFT data: every line checked when the file is indexed ----------------------------------------------------


def _sft_config(tmp_path: Path, tok: str, data: Path, packed: bool = False, **dataset: object) -> Path:
    from longspan.training.config import FinetuningDatasetConfig
    from tests.training.pretrain_helpers import small_config

    cfg = small_config(tmp_path, "sft", train_iters=2, eval_interval=100)
    cfg.tokenizer.tokenizer_type = "HuggingFaceTokenizer"
    cfg.tokenizer.tokenizer_model = tok
    cfg.tokenizer.vocab_size = None
    cfg.dataset = FinetuningDatasetConfig(
        dataset_root=str(data), seq_length=64, num_workers=0, do_validation=False,
        packed_sequence_specs={"packed_sequence_size": 64} if packed else None, **dataset)
    path = tmp_path / "sft.yaml"
    path.write_text(cfg.to_yaml())
    return path


@pytest.fixture(scope="module")
def sft_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tests.data.sft.conftest import make_hf_tokenizer_dir

    return make_hf_tokenizer_dir(str(tmp_path_factory.mktemp("tok") / "tok"))


@pytest.mark.parametrize("damage,fragment", [
    ('{"input": "a", "output": ', "line 5: not valid JSON"),
    ('["input", "output"]', "line 5: expected a JSON object, got list"),
    ('{"question": "a", "output": "b"}', "line 5: the record has no 'input' key"),
], ids=["truncated", "not-an-object", "missing-key"])
def test_bad_sft_line_5_of_10000_stops_before_iteration_1(
    tmp_path: Path, capsys: pytest.CaptureFixture, sft_tokenizer: str, damage: str, fragment: str
) -> None:
    from tests.data.sft.conftest import qa_records, write_jsonl

    records: list = qa_records(10_000)
    records[4] = damage
    data = tmp_path / "data"
    write_jsonl(str(data / "training.jsonl"), records)
    config = _sft_config(tmp_path, sft_tokenizer, data)
    code = main(["pretrain", "--config", str(config)])
    out, err = capsys.readouterr()
    assert_one_line(code, err, f"{data / 'training.jsonl'} {fragment}")
    assert "consumed samples:" not in out  # stopped before the first training step's log line
    assert not any((tmp_path / "sft").rglob("iter_*"))


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
@pytest.mark.parametrize("where", ["LONGSPAN_CACHE", "path_to_cache"])
def test_read_only_sft_directory_caches_elsewhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sft_tokenizer: str, packed: bool, where: str
) -> None:
    from longspan.data.loaders import build_train_valid_test_datasets
    from longspan.data.sft import jsonl_index
    from longspan.data.tokenizers import HuggingFaceTokenizer
    from longspan.training.config import FinetuningDatasetConfig
    from tests.data.conftest import run_config
    from tests.data.sft.conftest import qa_records, write_jsonl

    data = tmp_path / "data"
    write_jsonl(str(data / "training.jsonl"), qa_records(30, seed=1))
    write_jsonl(str(data / "validation.jsonl"), qa_records(6, seed=2))
    cache = tmp_path / "cache"
    monkeypatch.setenv("LONGSPAN_CACHE", str(cache if where == "LONGSPAN_CACHE" else tmp_path / "unused"))
    before = sorted(p.name for p in data.iterdir())
    data.chmod(0o555)
    if os.geteuid() == 0:  # root writes through permission bits: make the probe see what a user would
        probe = jsonl_index.is_writable_directory
        monkeypatch.setattr(jsonl_index, "is_writable_directory",
                            lambda d: False if Path(d) == data else probe(d))
    try:
        dataset = FinetuningDatasetConfig(
            dataset_root=str(data), seq_length=64, num_workers=0,
            packed_sequence_specs={"packed_sequence_size": 64} if packed else None)
        if where == "path_to_cache":
            dataset.path_to_cache = str(cache)  # Megatron's field name, read when a config carries it
        view = run_config(dataset, 64, micro_batch_size=2, global_batch_size=4, train_iters=3, eval_iters=1,
                          eval_interval=3)
        tok = HuggingFaceTokenizer(sft_tokenizer)
        first = build_train_valid_test_datasets(view, tok)
        assert first[0][0]["tokens"].numel() > 0
        cached = sorted(str(p.relative_to(cache)) for p in cache.rglob("*") if p.is_file())
        assert any(c.endswith("training.jsonl.idx.npy") for c in cached), cached
        assert any(c.endswith(".npy") and "packed" in c for c in cached) == packed, cached
        # reused on the next run: the files are not scanned again
        scans = []
        build = jsonl_index.JsonlIndex._build
        monkeypatch.setattr(jsonl_index.JsonlIndex, "_build", lambda self, w: scans.append(self.path) or build(self, w))
        again = build_train_valid_test_datasets(view, tok)
        assert scans == [] and again[0][0]["tokens"].tolist() == first[0][0]["tokens"].tolist()
    finally:
        data.chmod(0o755)
    assert sorted(p.name for p in data.iterdir()) == before
