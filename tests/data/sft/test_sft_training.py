"""SFT data through the real trainer (``pretrain``): train metrics count loss tokens, not padding, and a stopped
and resumed run (dropout on) continues with exactly the same samples and losses, packed or not."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.data.sft.conftest import make_hf_tokenizer_dir, qa_records, write_jsonl
from tests.training.pretrain_helpers import read_metrics, small_config

SEQ = 64


@pytest.fixture(scope="module")
def sft_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    tok = make_hf_tokenizer_dir(str(root / "tok"))
    write_jsonl(str(root / "data" / "training.jsonl"), qa_records(40, seed=1, skew=True))
    write_jsonl(str(root / "data" / "validation.jsonl"), qa_records(8, seed=2))
    return root, tok


def _config(root: Path, tok: str, name: str, iters: int = 4, packed: bool = False, dropout: float = 0.0,
            **dataset_kwargs):
    from longspan.training.config import FinetuningDatasetConfig

    cfg = small_config(root, name, train_iters=iters, eval_interval=100)
    cfg.tokenizer.tokenizer_type = "HuggingFaceTokenizer"
    cfg.tokenizer.tokenizer_model = tok
    cfg.tokenizer.vocab_size = None
    cfg.model.hidden_dropout = dropout
    cfg.model.attention_dropout = dropout
    cfg.dataset = FinetuningDatasetConfig(
        dataset_root=str(root / "data"), seq_length=SEQ, num_workers=0, do_validation=False,
        packed_sequence_specs={"packed_sequence_size": SEQ} if packed else None, dataset_kwargs=dataset_kwargs or None)
    return cfg


def _expected_real_tokens(cfg, tokenizer_dir: str, iters: int) -> list[int]:
    """The unpadded tokens of each global batch, from the dataset's samples (the oracle for tokens/s)."""
    from longspan.data.loaders import build_train_valid_test_datasets
    from longspan.data.tokenizers import HuggingFaceTokenizer

    train = build_train_valid_test_datasets(cfg, HuggingFaceTokenizer(tokenizer_dir))[0]
    gbs = cfg.train.global_batch_size
    return [sum(train[i]["tokens"].numel() for i in range(k * gbs, (k + 1) * gbs)) for k in range(iters)]


def _expected_loss_tokens(cfg, tokenizer_dir: str, iters: int) -> list[int]:
    """Σloss_mask of each global batch, from the dataset's samples (the oracle for the logged count)."""
    from longspan.data.loaders import build_train_valid_test_datasets
    from longspan.data.tokenizers import HuggingFaceTokenizer

    train = build_train_valid_test_datasets(cfg, HuggingFaceTokenizer(tokenizer_dir))[0]
    gbs = cfg.train.global_batch_size
    return [int(sum(float(train[i]["loss_mask"].sum()) for i in range(k * gbs, (k + 1) * gbs))) for k in range(iters)]


@pytest.mark.parametrize("per_token", [False, True], ids=["microbatch_mean", "per_token_loss"])
def test_logged_loss_and_token_counts_ignore_padding(sft_dirs, per_token, caplog, capfd):
    """Padded to seq_length (set explicitly) or to each microbatch's longest sample (the default without
    pipeline parallel): the same losses and loss tokens; tokens/s, the start-up and the summary lines count the
    real tokens and say how much is padding."""
    from longspan.training.step.forward_step import forward_step
    from longspan.training.pretrain import pretrain

    root, tok = sft_dirs
    padded = _config(root, tok, f"padded_{per_token}", pad_to_max_length=True)  # every microbatch seq_length wide
    tight = _config(root, tok, f"tight_{per_token}")  # the default: to the longest sample, a multiple of 16
    padded.model.calculate_per_token_loss = tight.model.calculate_per_token_loss = per_token
    def run(cfg) -> list[str]:  # the lines go to the console handler, or to caplog once it has taken over
        caplog.clear()
        capfd.readouterr()
        with caplog.at_level("INFO"):
            pretrain(cfg, forward_step)
        out = capfd.readouterr()
        return [r.getMessage() for r in caplog.records] + (out.out + out.err).splitlines()

    padded_lines, tight_lines = run(padded), run(tight)
    a, b = read_metrics(padded), read_metrics(tight)
    expected = _expected_loss_tokens(padded, tok, 4)
    assert [r["loss_tokens"] for r in a] == [r["loss_tokens"] for r in b] == expected
    assert len(set(expected)) > 1  # uneven masks: the counts differ between global batches
    for ra, rb in zip(a, b):
        assert math.isclose(ra["losses"]["lm loss"], rb["losses"]["lm loss"], rel_tol=1e-5)
    assert a[-1]["losses"]["lm loss"] < a[0]["losses"]["lm loss"]
    real = _expected_real_tokens(padded, tok, 4)
    assert len(set(real)) > 1 and max(real) < padded.train.global_batch_size * SEQ
    for records in (a, b):  # tokens/s counts real tokens, however the batches were padded
        assert [r["tokens"] for r in records] == real
        assert all(math.isclose(r["tokens_per_s"], r["tokens"] / r["iteration_time_s"]) for r in records[1:])
    for lines in (padded_lines, tight_lines):
        done = next(line for line in lines if line.startswith("longspan: done:"))
        assert f"({sum(real)} real tokens; padding " in done, done
        # no test.jsonl and do_validation=False: no samples reported for those splits
        assert any("longspan: samples train/valid/test 32/0/0 (" in line for line in lines)
        start = next(line for line in lines if line.startswith("longspan: SFT samples:"))
        assert "real tokens on average" in start and f"of seq_length={SEQ}" in start, start
    assert "padded to seq_length=64: about " in next(x for x in padded_lines if x.startswith("longspan: SFT samples"))
    assert "padded to their longest sample (a multiple of 16)" in next(
        x for x in tight_lines if x.startswith("longspan: SFT samples"))
    share = [float(next(x for x in lines if x.startswith("longspan: done:")).split("padding ")[1].split("%")[0])
             for lines in (padded_lines, tight_lines)]
    assert share[1] < share[0]  # padding to the longest sample pads less


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_stop_and_resume_is_exact_with_dropout(sft_dirs, packed):
    from longspan.training.step.forward_step import forward_step
    from longspan.training.pretrain import pretrain

    root, tok = sft_dirs
    name = "packed" if packed else "plain"
    full = _config(root, tok, f"full_{name}", iters=5, packed=packed, dropout=0.1)
    full.checkpoint.save_interval = 2
    pretrain(full, forward_step)
    resumed = _config(root, tok, f"resumed_{name}", iters=5, packed=packed, dropout=0.1)
    resumed.checkpoint.load = full.checkpoint.save
    resumed.checkpoint.ckpt_step = 2
    pretrain(resumed, forward_step)
    want = {r["iteration"]: (r["losses"]["lm loss"], r["loss_tokens"]) for r in read_metrics(full)}
    got = {r["iteration"]: (r["losses"]["lm loss"], r["loss_tokens"]) for r in read_metrics(resumed)}
    assert sorted(got) == [3, 4, 5]
    for it in (3, 4, 5):
        assert got[it] == want[it], (it, got[it], want[it])
