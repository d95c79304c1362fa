"""In-batch packing of the direct HF SFT data: a packed microbatch gives the unpacked microbatch's loss sum, token
count and gradients (fp32, rel <= 1e-5; uneven lengths and loss masks) through the trainer's forward step,
collate-time and step-time (deferred) packing give the same batches and losses, and
in_batch_packing_pad_to_multiple_of lays the pack out as documented."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from longspan.config.schema.container import ConfigContainer
from longspan.config.schema.data_hf import DirectHFSFTDatasetConfig, HFDatasetSourceConfig
from longspan.data.sft.formatting import SFTFormatOptions
from longspan.data.sft.hf_dataset import TokenizedSFTDataset
from longspan.data.sft.in_batch_packing import InBatchPacking, pack_padded_batch, pack_rows
from longspan.training.observability.timers import Timers
from longspan.training.step.forward_step import forward_step
from tests.data.sft.test_sft_packing import tiny_provider

SEQ = 32
PAD = 1
REL = 1e-5


def _docs(n: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Records of 4..SEQ+1 ids whose loss covers an uneven tail (a prompt without loss, then the answer)."""
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(n):
        length = int(rng.integers(4, SEQ + 2))
        ids = rng.integers(2, 128, length).astype(np.int64)
        in_loss = np.zeros(length, dtype=np.int8)
        in_loss[int(rng.integers(1, length - 1)):] = 1
        docs.append((ids, in_loss))
    return docs


def _dataset(docs, packing=None) -> TokenizedSFTDataset:
    opts = SFTFormatOptions(answer_only_loss=True, pad_to_max_length=False, pad_seq_length_to_mult=8, chat=True)
    return TokenizedSFTDataset(docs, SEQ, opts, PAD, list(range(len(docs))), packing)


def _state(packing: InBatchPacking | None) -> SimpleNamespace:
    """What the trainer's forward step reads from the GlobalState."""
    dataset = DirectHFSFTDatasetConfig(seq_length=SEQ, source=HFDatasetSourceConfig(path_or_dataset="unused.jsonl"),
                                       enable_in_batch_packing=packing is not None,
                                       defer_in_batch_packing_to_step=bool(packing and packing.deferred),
                                       in_batch_packing_pad_to_multiple_of=packing.pad_to_multiple_of if packing else 1)
    cfg = ConfigContainer(model=tiny_provider(seq=4 * SEQ, num_layers=2), dataset=dataset)
    return SimpleNamespace(timers=Timers(0, "minmax"), device=torch.device("cpu"), cfg=cfg,
                           tokenizer=SimpleNamespace(pad=PAD))


def _loss_and_grads(model, batch, packing):
    model.zero_grad(set_to_none=True)
    output, loss_func = forward_step(_state(packing), iter([batch]), model)
    loss_sum, num_tokens, _ = loss_func(output)
    (loss_sum / num_tokens).backward()
    return float(loss_sum), int(num_tokens), [p.grad.clone() for p in model.parameters()]


@pytest.fixture(scope="module")
def model():
    from longspan.models.gpt import build_gpt_model

    return build_gpt_model(tiny_provider(seq=4 * SEQ, num_layers=2), seed=1234, device="cpu")


def test_packed_microbatch_gives_the_unpacked_loss_and_gradients(model):
    docs = _docs(8, seed=3)
    plain = _dataset(docs)
    samples = [plain[i] for i in range(4)]
    want_sum, want_count, want_grads = _loss_and_grads(model, plain.collate_fn(samples), None)
    assert 0 < want_count < sum(s["tokens"].numel() for s in samples)
    for multiple in (1, 3):
        losses = []
        for deferred in (False, True):
            packing = InBatchPacking(multiple, deferred)
            batch = _dataset(docs, packing).collate_fn(samples)
            assert ("sequence_lengths" in batch) == deferred and batch["tokens"].shape[0] == (4 if deferred else 1)
            got_sum, got_count, got_grads = _loss_and_grads(model, batch, packing)
            assert got_count == want_count
            assert abs(got_sum - want_sum) <= REL * abs(want_sum), (multiple, deferred, got_sum, want_sum)
            for got, want in zip(got_grads, want_grads):
                assert torch.allclose(got, want, rtol=REL, atol=REL * float(want.abs().max())), (multiple, deferred)
            losses.append(got_sum)
        assert losses[0] == losses[1]  # deferred packing builds the very batch the collate builds


def test_deferred_packing_builds_the_collates_batch():
    docs = _docs(6, seed=5)
    samples = [_dataset(docs)[i] for i in range(3, 6)]
    packed = _dataset(docs, InBatchPacking(4)).collate_fn(samples)
    padded = _dataset(docs, InBatchPacking(4, deferred=True)).collate_fn(samples)
    deferred = pack_padded_batch(padded, PAD, 4)
    assert set(deferred) == set(packed)
    for key in packed:
        assert torch.equal(deferred[key], packed[key]), key


def test_pad_to_multiple_of_sets_the_packed_layout():
    def row(n, first):
        tokens = torch.arange(first, first + n)
        return {"tokens": tokens, "labels": tokens + 1, "loss_mask": torch.ones(n)}

    rows = [row(3, 10), row(5, 20), row(2, 30)]
    tight = pack_rows(rows, PAD, 1)
    assert tight["tokens"].tolist() == [[10, 11, 12, 20, 21, 22, 23, 24, 30, 31]]
    assert tight["cu_seqlens"].tolist() == [[0, 3, 8, 10]]
    assert tight["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 4, 0, 1]]
    aligned = pack_rows(rows, PAD, 4)  # each sample padded to a multiple of 4: 4 + 8 + 4
    assert aligned["tokens"].tolist() == [[10, 11, 12, PAD, 20, 21, 22, 23, 24, PAD, PAD, PAD, 30, 31, PAD, PAD]]
    assert aligned["cu_seqlens"].tolist() == [[0, 4, 12, 16]]
    assert aligned["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]]
    assert aligned["loss_mask"].tolist() == [[1, 1, 1, 0, 1, 1, 1, 1, 1, 0, 0, 0, 1, 1, 0, 0]]
    mask = aligned["attention_mask"][0, 0]  # True = masked: causal inside a sample, nothing across samples
    assert mask.shape == (16, 16) and not mask[5, 4] and mask[4, 3] and mask[4, 5] and mask[12, 11] and not mask[15, 12]


def _packed_run(tmp_path, name: str, tokenizer_dir: str, train: str, valid: str, packing: str):
    import yaml

    from longspan.training.config import ConfigContainer
    from tests.training.pretrain_helpers import small_config

    cfg = small_config(tmp_path, name, train_iters=3, eval_interval=3, eval_iters=1)
    cfg.train.micro_batch_size, cfg.train.global_batch_size = 4, 8
    cfg.checkpoint.save = cfg.checkpoint.load = None
    cfg.tokenizer.tokenizer_type, cfg.tokenizer.tokenizer_model, cfg.tokenizer.vocab_size = (
        "HuggingFaceTokenizer", tokenizer_dir, None)
    data = cfg.to_dict()
    data["dataset"] = yaml.safe_load(f"""
_target_: megatron.bridge.data.builders.direct_hf_sft.DirectHFSFTDatasetConfig
seq_length: 64
source: {{path_or_dataset: {train}}}
validation_source: {{path_or_dataset: {valid}}}
do_test: false
num_workers: 0
pad_to_multiple_of: 16
{packing}
""")
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return ConfigContainer.from_yaml(str(path))


def test_training_on_packed_microbatches_matches_the_unpacked_run(tmp_path, hf_sft_tokenizer_dir, monkeypatch):
    """The real trainer (datasets, loaders, the step-time packing, evaluation): per-iteration losses, loss-token
    counts and the validation loss of a deferred-packed run equal the unpacked run's."""
    import json
    from pathlib import Path

    from longspan.training.pretrain import pretrain
    from longspan.training.step import forward_step as step_module
    from longspan.training.step.forward_step import forward_step
    from tests.data.sft_hf.conftest import conversations, write_jsonl
    from tests.training.pretrain_helpers import read_metrics

    convs = conversations(30, seed=7)
    train = write_jsonl(str(tmp_path / "data" / "train.jsonl"), [{"messages": c} for c in convs[:24]])
    valid = write_jsonl(str(tmp_path / "data" / "valid.jsonl"), [{"messages": c} for c in convs[24:]])
    packed_widths = []

    def recording_pack(batch, pad_id, multiple):
        packed = pack_padded_batch(batch, pad_id, multiple)
        packed_widths.append((batch["tokens"].shape, packed["tokens"].shape))
        return packed

    monkeypatch.setattr(step_module, "pack_padded_batch", recording_pack)
    results = []
    for name, packing in (("plain", ""), ("packed", "enable_in_batch_packing: true\ndefer_in_batch_packing_to_step: "
                                                    "true\nin_batch_packing_pad_to_multiple_of: 4")):
        run = _packed_run(tmp_path, name, hf_sft_tokenizer_dir, train, valid, packing)
        pretrain(run, forward_step)
        lines = (Path(run.logger.tensorboard_dir) / "metrics.jsonl").read_text().splitlines()
        validation = [json.loads(x)["losses"]["lm loss"] for x in lines if '"validation"' in x]
        results.append(([(r["losses"]["lm loss"], r["loss_tokens"]) for r in read_metrics(run)], validation))
    (plain, plain_valid), (packed, packed_valid) = results
    assert len(packed_widths) == 3 * 2 + 2  # every training and validation microbatch packed in the step
    assert all(before[0] == 4 and after[0] == 1 for before, after in packed_widths)
    assert len(plain) == 3 and len(plain_valid) == 1 and len({tokens for _, tokens in plain}) > 1
    for (want, want_tokens), (got, got_tokens) in zip(plain + [(plain_valid[0], 0)], packed + [(packed_valid[0], 0)]):
        assert got_tokens == want_tokens and abs(got - want) <= REL * abs(want), (got, want)
