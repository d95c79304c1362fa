"""Sequence packing: first-fit-decreasing, the pack layout (positions, block-diagonal mask), the packed-file
cache, and the acceptance: the loss of a packed batch equals the sum of its documents' losses computed one by
one (fp32, rel <= 1e-6) on one process, through the trainer's forward step and schedule."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from longspan.core.errors import ConfigError, DataError, NotSupportedError
from longspan.data.sft.packing import (
    PackedSequenceSpecs,
    collate_packs,
    first_fit_decreasing,
    pack_documents,
    pack_to_sample,
    resolve_packed_specs,
)
from tests.data.conftest import run_config
from tests.data.sft.conftest import qa_records, write_jsonl

PACK = 64
REL = 1e-6


def _naive_first_fit_decreasing(lengths, capacity, seed):
    """Oracle: the textbook O(n·bins) first-fit-decreasing with the same seeded tie-break."""
    tie = np.random.default_rng(seed).permutation(len(lengths))
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], tie[i]))
    bins, free = [], []
    for i in order:
        for b, room in enumerate(free):
            if room >= lengths[i]:
                bins[b].append(i)
                free[b] -= lengths[i]
                break
        else:
            bins.append([i])
            free.append(capacity - lengths[i])
    return bins


def test_first_fit_decreasing_matches_the_textbook_algorithm():
    rng = np.random.default_rng(0)
    lengths = [int(x) for x in rng.integers(1, 40, size=300)] + [5] * 20  # many ties
    bins = first_fit_decreasing(lengths, 64, seed=7)
    assert bins == _naive_first_fit_decreasing(lengths, 64, 7)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 64 for b in bins)
    assert first_fit_decreasing(lengths, 64, seed=7) == bins  # deterministic
    assert first_fit_decreasing(lengths, 64, seed=8) != bins  # the tie-break follows the seed
    with pytest.raises(DataError):
        first_fit_decreasing([65], 64, 0)


def _docs(n, seed=0, max_len=40):
    """(tokens, labels with -1 = no loss) of uneven lengths and uneven loss masks."""
    g = np.random.default_rng(seed)
    docs = []
    for _ in range(n):
        length = int(g.integers(3, max_len))
        ids = g.integers(1, 120, size=length + 1)
        labels = ids[1:].copy()
        prompt = int(g.integers(0, length - 1))
        labels[:prompt] = -1
        docs.append((ids[:-1], labels))
    return docs


def test_pack_layout_positions_mask_and_cu_seqlens():
    docs = _docs(30, seed=1)
    packs, meta = pack_documents(docs, PACK, seed=0, pad_id=0, pad_to_mult=4)
    assert meta["num_documents"] == 30 and meta["num_packs"] == packs.shape[0]
    assert 0.5 < meta["useful_token_fraction"] <= 1.0
    seen = 0
    for pack in packs:
        s = pack_to_sample(pack)
        doc = pack[2]
        for i in range(PACK):
            start = i
            while start > 0 and doc[start - 1] == doc[i]:
                start -= 1
            assert s["position_ids"][i] == i - start
            for j in range(PACK):
                assert bool(s["attention_mask"][0, i, j]) == (not (j <= i and doc[j] == doc[i]))
        assert s["cu_seqlens"][0] == 0 and s["cu_seqlens"][-1] == PACK
        # every document is padded to a multiple of 4 inside its pack
        assert all(int(d) % 4 == 0 for d in np.diff(s["cu_seqlens"].numpy())[:-1])
        seen += int(s["loss_mask"].sum())
    assert seen == sum(int((lab >= 0).sum()) for _, lab in docs)
    fixed = pack_to_sample(packs[0], cu_length=meta["max_samples_per_bin"] + 2)
    assert fixed["cu_seqlens"].numel() == meta["max_samples_per_bin"] + 2
    batch = collate_packs([pack_to_sample(p) for p in packs[:3]])
    assert batch["attention_mask"].shape == (3, 1, PACK, PACK) and batch["cu_seqlens"].shape[0] == 3


def tiny_provider(seq=PACK, **overrides):
    import torch.nn.functional as F

    from longspan.models.gpt_provider import GPTModelProvider

    kw = dict(num_layers=4, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
              seq_length=seq, vocab_size=128, make_vocab_size_divisible_by=128, normalization="RMSNorm",
              position_embedding_type="rope", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
              attention_dropout=0.0, hidden_dropout=0.0, share_embeddings_and_output_weights=False)
    kw.update(overrides)
    provider = GPTModelProvider(**kw)
    provider.finalize()
    return provider


def per_document_loss_sums(model, docs, members_per_microbatch):
    """Σ(loss·mask) and Σmask per microbatch, each document run through the model on its own."""
    out = []
    with torch.no_grad():
        for members in members_per_microbatch:
            total, count = 0.0, 0
            for d in members:
                tokens, labels = docs[d]
                mask = torch.from_numpy((labels >= 0).astype(np.float32))
                lab = torch.from_numpy(np.maximum(labels, 0)).long()
                loss = model(torch.from_numpy(tokens).long()[None], labels=lab[None])[0]
                total += float((loss.double() * mask.double()).sum())
                count += int(mask.sum())
            out.append((total, count))
    return out


def packed_forward_step_state(pack_size=PACK):
    """What the trainer's forward step reads from the GlobalState (timers, device, the model and dataset configs)."""
    from longspan.config.schema.container import ConfigContainer
    from longspan.config.schema.data import FinetuningDatasetConfig
    from longspan.training.observability.timers import Timers

    dataset = FinetuningDatasetConfig(packed_sequence_specs={"packed_sequence_size": pack_size})
    cfg = ConfigContainer(model=tiny_provider(seq=pack_size), dataset=dataset)
    return SimpleNamespace(timers=Timers(0, "minmax"), device=torch.device("cpu"), cfg=cfg)


def packed_microbatches(docs, mbs, seed=0, pad_to_mult=1):
    """Microbatches of packs (the collated batches a PackedSFTDataset loader yields) and their documents."""
    packs, _ = pack_documents(docs, PACK, seed=seed, pad_id=0, pad_to_mult=pad_to_mult)
    bins = first_fit_decreasing([-(-len(t) // pad_to_mult) * pad_to_mult for t, _ in docs], PACK, seed)
    batches, members = [], []
    for start in range(0, len(packs) - mbs + 1, mbs):
        batches.append(collate_packs([pack_to_sample(p) for p in packs[start:start + mbs]]))
        members.append([d for b in bins[start:start + mbs] for d in b])
    return batches, members


def _assert_reports_match(reports, reference):
    assert len(reports) == len(reference)
    for report, (want_sum, want_count) in zip(reports, reference):
        got_sum, got_count = float(report["lm loss"][0]), float(report["lm loss"][1])
        assert got_count == want_count
        assert abs(got_sum - want_sum) <= REL * abs(want_sum), (got_sum, want_sum)


@pytest.mark.parametrize("pad_to_mult", [1, 8])
def test_packed_loss_equals_per_document_losses_one_process(pad_to_mult):
    from functools import partial

    from longspan.models.gpt import build_gpt_model
    from longspan.training.step.forward_step import forward_step
    from longspan.training.step.schedules import forward_backward_no_pipelining

    torch.manual_seed(0)
    model = build_gpt_model(tiny_provider(), seed=1234, device="cpu")
    docs = _docs(40, seed=3)
    batches, members = packed_microbatches(docs, mbs=2, pad_to_mult=pad_to_mult)
    assert all(len(m) > 2 for m in members)
    reports, tokens = forward_backward_no_pipelining(
        forward_step_func=partial(forward_step, packed_forward_step_state()), data_iterator=iter(batches),
        model=[model], num_microbatches=len(batches), forward_only=True)
    reference = per_document_loss_sums(model, docs, members)
    _assert_reports_match(reports, reference)
    assert int(tokens) == sum(c for _, c in reference)
    # without the document mask the loss would differ (the mask is what makes the packs exact)
    plain = model(batches[0]["tokens"], labels=batches[0]["labels"])
    assert abs(float((plain * batches[0]["loss_mask"]).sum()) - reference[0][0]) > 1e-3


def test_learned_absolute_positions_restart_per_document():
    from longspan.models.gpt import build_gpt_model

    model = build_gpt_model(tiny_provider(position_embedding_type="learned_absolute"), seed=5, device="cpu")
    docs = _docs(12, seed=4)
    batches, members = packed_microbatches(docs, mbs=1)
    with torch.no_grad():
        for batch, ref in zip(batches, per_document_loss_sums(model, docs, members)):
            loss = model(batch["tokens"], position_ids=batch["position_ids"], attention_mask=batch["attention_mask"],
                         labels=batch["labels"])
            assert abs(float((loss.double() * batch["loss_mask"]).sum()) - ref[0]) <= REL * abs(ref[0])


# ------------------------------------------------------------------------------- specs and packed files

def test_specs_resolution():
    assert resolve_packed_specs(None) is None
    assert resolve_packed_specs({"packed_sequence_size": -1}) is None
    specs = resolve_packed_specs({"_target_": "megatron.bridge.data.datasets.packed_sequence.PackedSequenceSpecs",
                                  "packed_sequence_size": 64, "pad_cu_seqlens": True})
    assert specs == PackedSequenceSpecs(packed_sequence_size=64, pad_cu_seqlens=True)
    assert resolve_packed_specs(PackedSequenceSpecs(packed_sequence_size=32)).packed_sequence_size == 32
    with pytest.raises(NotSupportedError, match="unknown field"):
        resolve_packed_specs({"packed_sequence_size": 64, "pack_size": 3})
    with pytest.raises(NotSupportedError, match="num_tokenizer_workers"):
        resolve_packed_specs({"packed_sequence_size": 64, "num_tokenizer_workers": 4})
    with pytest.raises(ConfigError, match="max_single_sequence_length"):
        resolve_packed_specs({"packed_sequence_size": 64, "max_single_sequence_length": 65})


def _cfg(root, specs, seq=PACK, **dataset):
    from longspan.config.schema.data import FinetuningDatasetConfig

    d = FinetuningDatasetConfig(dataset_root=str(root), seq_length=seq, num_workers=0,
                                packed_sequence_specs=specs, **dataset)
    return run_config(d, seq, micro_batch_size=2, global_batch_size=4, train_iters=5, eval_iters=1, eval_interval=5)


def test_packed_files_are_built_once_beside_the_data_and_resume(tmp_path, tokenizer):
    from longspan.data.loaders import build_train_valid_test_data_iterators, build_train_valid_test_datasets

    write_jsonl(str(tmp_path / "training.jsonl"), qa_records(60, seed=1, skew=True))
    write_jsonl(str(tmp_path / "validation.jsonl"), qa_records(10, seed=2))
    meta_file = str(tmp_path / "meta.json")
    cfg = _cfg(tmp_path, {"packed_sequence_size": PACK, "packed_metadata_path": meta_file, "pad_cu_seqlens": True})
    train, valid, test = build_train_valid_test_datasets(cfg, tokenizer)
    packed = tmp_path / "packed" / "HuggingFaceTokenizer" / f"training_{PACK}.npy"
    assert train.path == str(packed) and valid.path.endswith(f"validation_{PACK}.npy") and test is None
    meta = json.load(open(str(packed) + ".meta.json"))
    assert meta["num_documents"] == 60 and len(json.load(open(meta_file))) == 2
    assert len(train) == 20  # train_iters x global_batch_size packs, over epochs
    mtime = os.stat(packed).st_mtime_ns
    build_train_valid_test_datasets(cfg, tokenizer)
    assert os.stat(packed).st_mtime_ns == mtime  # reused
    cfg2 = _cfg(tmp_path, {"packed_sequence_size": PACK}, dataset_kwargs={"add_eos": False})
    build_train_valid_test_datasets(cfg2, tokenizer)
    assert os.stat(packed).st_mtime_ns != mtime  # other formatting options: rebuilt
    # batches: a block-diagonal mask, position ids restarting, fixed-width cu_seqlens; exact resume
    state = SimpleNamespace(consumed_train_samples=0, consumed_valid_samples=0)
    it, _, _ = build_train_valid_test_data_iterators(cfg, state, tokenizer)
    batches = [next(it) for _ in range(6)]
    assert batches[0]["attention_mask"].shape == (2, 1, PACK, PACK)
    assert batches[0]["cu_seqlens"].shape == (2, meta["max_samples_per_bin"] + 2)
    assert (batches[0]["position_ids"][:, 1:] == 0).any()  # a document starts inside a pack
    state.consumed_train_samples = 6
    resumed, _, _ = build_train_valid_test_data_iterators(cfg, state, tokenizer)
    for want in batches[3:]:
        got = next(resumed)
        assert all(torch.equal(want[k], got[k]) for k in want)


def test_explicit_packed_paths_and_size_checks(tmp_path, tokenizer):
    from longspan.data.loaders import build_train_valid_test_datasets

    write_jsonl(str(tmp_path / "training.jsonl"), qa_records(30, seed=1))
    out = str(tmp_path / "elsewhere" / "train.npy")
    cfg = _cfg(tmp_path, {"packed_sequence_size": PACK, "packed_train_data_path": out}, do_validation=False)
    train = build_train_valid_test_datasets(cfg, tokenizer)[0]
    assert train.path == out and os.path.isfile(out)
    os.remove(tmp_path / "training.jsonl")  # a given packed file is used without its source
    assert build_train_valid_test_datasets(cfg, tokenizer)[0].path == out
    with pytest.raises(ConfigError, match="packed_sequence_size=32 differs from model.seq_length=64"):
        build_train_valid_test_datasets(_cfg(tmp_path, {"packed_sequence_size": 32}), tokenizer)
    np.save(str(tmp_path / "wrong.npy"), np.zeros((2, 3, 32), np.int32))
    cfg = _cfg(tmp_path, {"packed_sequence_size": PACK, "packed_train_data_path": str(tmp_path / "wrong.npy")},
               do_validation=False)
    with pytest.raises(DataError, match="packs of 32 tokens"):
        build_train_valid_test_datasets(cfg, tokenizer)


def test_preprocess_pack_sft_writes_the_files_training_reuses(tmp_path, hf_tokenizer_dir, tokenizer, capsys):
    from longspan.cli import main
    from longspan.data.loaders import build_train_valid_test_datasets

    write_jsonl(str(tmp_path / "training.jsonl"), qa_records(50, seed=1, skew=True))
    write_jsonl(str(tmp_path / "validation.jsonl"), qa_records(6, seed=2))
    kwargs = '{"add_bos": true}'
    assert main(["preprocess", "--pack-sft", str(tmp_path), "--packed-sequence-size", str(PACK),
                 "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", hf_tokenizer_dir,
                 "--seed", "7", "--dataset-kwargs", kwargs]) == 0
    packed = tmp_path / "packed" / "HuggingFaceTokenizer" / f"training_{PACK}.npy"
    mtime = os.stat(packed).st_mtime_ns
    assert os.path.isfile(tmp_path / "packed" / "HuggingFaceTokenizer" / f"validation_{PACK}.npy")
    cfg = _cfg(tmp_path, {"packed_sequence_size": PACK}, seed=7, dataset_kwargs=json.loads(kwargs))
    train = build_train_valid_test_datasets(cfg, tokenizer)[0]
    assert train.path == str(packed) and os.stat(packed).st_mtime_ns == mtime  # reused, not rebuilt
    assert int(train[0]["tokens"][0]) == tokenizer.bos  # the dataset_kwargs given to preprocess were applied
    # missing pack size: a one-line error, exit code 2
    assert main(["preprocess", "--pack-sft", str(tmp_path), "--tokenizer-type", "HuggingFaceTokenizer",
                 "--tokenizer-model", hf_tokenizer_dir]) == 2
    assert "--packed-sequence-size" in capsys.readouterr().err


def test_specs_round_trip_through_yaml_and_bridge_names():
    from longspan.config.serialize import container_from_dict, to_dict
    from longspan.recipes import get_recipe
    from longspan.training.config import FinetuningDatasetConfig
    from longspan.training.config import PackedSequenceSpecs as Exported

    assert Exported is PackedSequenceSpecs
    cfg = get_recipe("tiny")
    cfg.dataset = FinetuningDatasetConfig(dataset_root="/data", packed_sequence_specs=PackedSequenceSpecs(
        packed_sequence_size=PACK, pad_cu_seqlens=True))
    data = to_dict(cfg)
    assert container_from_dict(data).dataset.packed_sequence_specs == cfg.dataset.packed_sequence_specs
    # a Megatron Bridge run_config names its own classes
    data["dataset"]["_target_"] = "megatron.bridge.training.config.FinetuningDatasetConfig"
    data["dataset"]["packed_sequence_specs"]["_target_"] = (
        "megatron.bridge.data.datasets.packed_sequence.PackedSequenceSpecs")
    loaded = container_from_dict(data).dataset.packed_sequence_specs
    assert resolve_packed_specs(loaded) == PackedSequenceSpecs(packed_sequence_size=PACK, pad_cu_seqlens=True)
