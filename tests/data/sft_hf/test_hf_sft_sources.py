"""The same conversations in the file formats users hold give the same token ids and loss masks; the columns
pick the schema; two sources blend in the configured proportion and resume exactly."""

from __future__ import annotations

import numpy as np
import pytest

from longspan.data.sft.chat_loss import never_trained_ids

from longspan.config.schema.data_hf import ChatSFTPreprocessingConfig, DirectHFSFTDatasetConfig, HFDatasetSourceConfig
from longspan.core.errors import ConfigError
from longspan.data.sft.hf_dataset import build_direct_hf_sft_datasets
from longspan.data.sft.schemas import detect_adapter
from tests.data.sft_hf.conftest import (
    SEQ,
    as_alpaca,
    as_sharegpt,
    conversations,
    single_turn,
    snapshot,
    write_json_array,
    write_jsonl,
    write_parquet,
    write_saved_dataset,
)


def _docs(tokenizer, source: HFDatasetSourceConfig, n: int, **cfg) -> list[tuple[list[int], list[int]]]:
    d = DirectHFSFTDatasetConfig(seq_length=SEQ, source=source, num_workers=0, **cfg)
    train = build_direct_hf_sft_datasets(d, tokenizer, (n, 0, 0), SEQ)[0]
    return [(ids.tolist(), flags.tolist()) for ids, flags in train.docs]


def test_five_sources_give_identical_ids_and_masks(tmp_path, hf_sft_tokenizer):
    convs = conversations(50)
    data = tmp_path / "data"
    before = {}
    paths = {
        "messages_jsonl": write_jsonl(str(data / "messages.jsonl"), [{"messages": c} for c in convs]),
        "sharegpt_json": write_json_array(str(data / "sharegpt.json"), [as_sharegpt(c) for c in convs]),
        "parquet": write_parquet(str(data / "sharegpt.parquet"), [as_sharegpt(c) for c in convs]),
        "save_to_disk": write_saved_dataset(str(data / "saved"), {"train": [{"messages": c} for c in convs]}),
    }
    before = snapshot(str(data))
    reference = _docs(hf_sft_tokenizer, HFDatasetSourceConfig(path_or_dataset=paths["messages_jsonl"]), 50)
    assert len(reference) == 50
    assert all(0 < sum(flags) < len(flags) for _, flags in reference)  # prompts masked, replies trained
    assert len({len(ids) for ids, _ in reference}) > 5  # uneven lengths
    for name in ("sharegpt_json", "parquet", "save_to_disk"):
        assert _docs(hf_sft_tokenizer, HFDatasetSourceConfig(path_or_dataset=paths[name]), 50) == reference, name

    # Alpaca holds single-turn conversations only: its rows equal the messages file's single-turn rows.
    singles = single_turn(convs)
    assert 10 < len(singles) < 50 and any(c[0]["role"] == "system" for c in singles)
    alpaca = write_jsonl(str(data / "alpaca.jsonl"), [as_alpaca(c) for c in singles])
    singles_ref = write_jsonl(str(tmp_path / "ref" / "singles.jsonl"), [{"messages": c} for c in singles])
    assert _docs(hf_sft_tokenizer, HFDatasetSourceConfig(path_or_dataset=alpaca), 10) == _docs(
        hf_sft_tokenizer, HFDatasetSourceConfig(path_or_dataset=singles_ref), 10)
    # TRL prompt/completion in CSV, with renamed columns (single-turn rows without a system prompt)
    plain = [c for c in singles if c[0]["role"] != "system"]
    import csv

    with open(data / "qa.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["question", "answer"])
        writer.writerows([[c[0]["content"], c[1]["content"]] for c in plain])
    plain_ref = write_jsonl(str(tmp_path / "ref" / "plain.jsonl"), [{"messages": c} for c in plain])
    csv_source = HFDatasetSourceConfig(path_or_dataset=str(data / "qa.csv"),
                                       adapter_kwargs={"prompt_column": "question", "completion_column": "answer"})
    assert _docs(hf_sft_tokenizer, csv_source, 10) == _docs(
        hf_sft_tokenizer, HFDatasetSourceConfig(path_or_dataset=plain_ref), 10)
    # the data directory is read, never written (the datasets cache lives under LONGSPAN_CACHE)
    assert snapshot(str(data)).keys() - {str(data / "alpaca.jsonl"), str(data / "qa.csv")} == before.keys()
    assert all(snapshot(str(data))[p] == t for p, t in before.items())


def test_loss_mode_full_trains_every_token_and_data_files_split_mapping(tmp_path, hf_sft_tokenizer):
    convs = conversations(12, seed=3)
    train = write_jsonl(str(tmp_path / "t.jsonl"), [{"messages": c} for c in convs[:8]])
    valid = write_jsonl(str(tmp_path / "v.jsonl"), [{"messages": c} for c in convs[8:]])
    source = HFDatasetSourceConfig(path_or_dataset="json", load_kwargs={"data_files": {"train": train,
                                                                                       "validation": valid}})
    d = DirectHFSFTDatasetConfig(seq_length=SEQ, source=source, num_workers=0,
                                 preprocessing=ChatSFTPreprocessingConfig(loss_mode="full"))
    tr, va, te = build_direct_hf_sft_datasets(d, hf_sft_tokenizer, (16, 4, 4), SEQ)
    assert len(tr.docs) == 8 and len(va.docs) == 4 and te is None  # no test split: skipped
    # 'full' trains every token but the turn-start control tokens (Bridge's list), which no mode trains
    never = never_trained_ids(hf_sft_tokenizer)
    assert never, "the test tokenizer should have turn-start tokens"
    for ids, flags in tr.docs:
        assert all(bool(flag) == (int(token) not in never) for token, flag in zip(ids, flags))


@pytest.mark.parametrize("columns,kwargs,expected", [
    (["messages", "id"], None, "messages"),
    (["conversations"], None, "conversation"),
    (["conversation", "source"], None, "conversation"),
    (["instruction", "input", "output"], None, "alpaca"),
    (["prompt", "completion"], None, "prompt_completion"),
    (["text", "meta"], None, "text"),
    (["question", "answer"], {"prompt_column": "question", "completion_column": "answer"}, "prompt_completion"),
    (["chat"], {"messages_column": "chat"}, "messages"),
])
def test_adapter_detected_from_columns(columns, kwargs, expected):
    assert detect_adapter(columns, kwargs, "f.jsonl") == expected


def test_ambiguous_or_unknown_columns_stop_in_one_line():
    with pytest.raises(ConfigError, match=r"f.jsonl: columns \['messages', 'text'\] match several schemas"):
        detect_adapter(["messages", "text"], None, "f.jsonl")
    with pytest.raises(ConfigError, match=r"f.jsonl: columns \['a', 'b'\] match no known schema"):
        detect_adapter(["a", "b"], None, "f.jsonl")


def _blend_config(tmp_path, weights, seed=1234):
    convs = conversations(50, seed=5)
    a = write_jsonl(str(tmp_path / "a.jsonl"), [{"messages": c} for c in convs[:30]])
    b = write_jsonl(str(tmp_path / "b.jsonl"), [as_alpaca(c) for c in single_turn(conversations(60, seed=6))[:20]])
    return DirectHFSFTDatasetConfig(
        seq_length=SEQ, source=[HFDatasetSourceConfig(path_or_dataset=a), HFDatasetSourceConfig(path_or_dataset=b)],
        source_weights=weights, blend_seed=seed, do_validation=False, do_test=False, num_workers=0)


def test_blend_proportion_and_resume(tmp_path, hf_sft_tokenizer):
    from longspan.data.loaders import build_pretraining_data_loader

    d = _blend_config(tmp_path, [1.0, 3.0])
    train = build_direct_hf_sft_datasets(d, hf_sft_tokenizer, (2000, 0, 0), SEQ)[0]
    items = np.array([train.samples[i] for i in range(2000)])
    share_b = float((items >= 30).mean())
    assert abs(share_b - 0.75) <= 0.02
    for prefix in (100, 555, 1999):  # the share holds along the way, not only at the end
        assert abs(float((items[:prefix] >= 30).mean()) - 0.75) <= 0.02
    assert len(set(items[items < 30])) == 30 and len(set(items[items >= 30])) == 20  # every row is used
    # deterministic: a rebuild gives the same order; another blend_seed another one
    again = build_direct_hf_sft_datasets(d, hf_sft_tokenizer, (2000, 0, 0), SEQ)[0]
    assert [again.samples[i] for i in range(2000)] == items.tolist()
    other = build_direct_hf_sft_datasets(_blend_config(tmp_path, [1.0, 3.0], seed=7), hf_sft_tokenizer,
                                         (2000, 0, 0), SEQ)[0]
    assert [other.samples[i] for i in range(2000)] != items.tolist()
    # resume: a loader started at consumed_samples=k yields what a straight run yields after k samples
    kwargs = dict(micro_batch_size=2, num_workers=0, data_sharding=True)
    straight = iter(build_pretraining_data_loader(train, 0, "cyclic", **kwargs))
    batches = [next(straight) for _ in range(12)]
    resumed = iter(build_pretraining_data_loader(again, 14, "cyclic", **kwargs))
    for expected in batches[7:]:
        got = next(resumed)
        assert all(torch_equal(got[k], expected[k]) for k in expected)


def torch_equal(a, b) -> bool:
    import torch

    return bool(torch.equal(a, b))


def test_subset_selects_a_configuration_of_a_dataset_directory(tmp_path, hf_sft_tokenizer):
    convs = conversations(12, seed=8)
    root = tmp_path / "corpus"
    write_jsonl(str(root / "chat" / "part.jsonl"), [{"messages": c} for c in convs[:7]])
    write_jsonl(str(root / "more" / "part.jsonl"), [{"messages": c} for c in convs[7:]])
    (root / "README.md").write_text("---\nconfigs:\n- config_name: chat\n  data_files: chat/*.jsonl\n"
                                    "- config_name: more\n  data_files: more/*.jsonl\n---\n")
    one = _docs(hf_sft_tokenizer, HFDatasetSourceConfig(path_or_dataset=str(root), subset="more"), 5)
    both = _docs(hf_sft_tokenizer, HFDatasetSourceConfig(path_or_dataset=str(root), subset=["chat", "more"]), 12)
    ref = write_jsonl(str(tmp_path / "ref.jsonl"), [{"messages": c} for c in convs])
    expected = _docs(hf_sft_tokenizer, HFDatasetSourceConfig(path_or_dataset=ref), 12)
    assert one == expected[7:] and both == expected
    with pytest.raises(ConfigError, match=r"ref.jsonl: subset='more' names a configuration, but a single file"):
        _docs(hf_sft_tokenizer, HFDatasetSourceConfig(path_or_dataset=ref, subset="more"), 12)


def test_tool_calls_pass_through_and_text_rows_train_every_token(tmp_path, hf_sft_tokenizer_dir):
    from longspan.data.tokenizers import HuggingFaceTokenizer

    # a template that renders tool calls and tool results only when a message has them
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] %}{{ m['content'] }}"
                "{% endif %}{% if m.tool_calls is defined %}{% for c in m.tool_calls %}call {{ c['function']['name'] }}"
                "{% endfor %}{% endif %}{% if m.tool_call_id is defined %} id {{ m.tool_call_id }}{% endif %}"
                "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    call = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{\"q\": \"fox\"}"}}
    rows = [{"messages": [{"role": "user", "content": "hello fox"},
                          {"role": "assistant", "content": None, "tool_calls": [call]},
                          {"role": "tool", "content": "brown", "tool_call_id": "c1"},
                          {"role": "assistant", "content": "the fox is brown"}]},
            {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world"}]}]
    tokenizer = HuggingFaceTokenizer(hf_sft_tokenizer_dir)
    d = lambda path: DirectHFSFTDatasetConfig(  # noqa: E731
        seq_length=SEQ, source=HFDatasetSourceConfig(path_or_dataset=path), num_workers=0)
    jsonl = write_jsonl(str(tmp_path / "tools.jsonl"), rows)
    parquet = write_parquet(str(tmp_path / "tools.parquet"), rows)
    a = build_direct_hf_sft_datasets(d(jsonl), tokenizer, (2, 0, 0), SEQ, template)[0]
    b = build_direct_hf_sft_datasets(d(parquet), tokenizer, (2, 0, 0), SEQ, template)[0]
    text = tokenizer.detokenize(a.docs[0][0].tolist())
    assert "call lookup" in text and " id c1" in text and "tool_call_id" not in tokenizer.detokenize(a.docs[1][0].tolist())
    assert "call" not in tokenizer.detokenize(a.docs[1][0].tolist())  # Arrow's null keys do not reach the template
    assert [(x.tolist(), y.tolist()) for x, y in a.docs] == [(x.tolist(), y.tolist()) for x, y in b.docs]

    plain = write_jsonl(str(tmp_path / "text.jsonl"), [{"text": "the quick brown fox"}, {"text": "hello world"}])
    docs = build_direct_hf_sft_datasets(d(plain), tokenizer, (2, 0, 0), SEQ)[0].docs
    assert docs[0][0].tolist() == tokenizer.tokenize("the quick brown fox") + [tokenizer.eos]
    assert all(flags.all() for _, flags in docs)


def test_splits_padding_and_switches(tmp_path, hf_sft_tokenizer):
    convs = conversations(20, seed=9)
    path = write_saved_dataset(str(tmp_path / "saved"), {
        "train": [{"messages": c} for c in convs[:12]], "validation": [{"messages": c} for c in convs[12:16]],
        "test": [{"messages": c} for c in convs[16:]]})
    source = HFDatasetSourceConfig(path_or_dataset=path)
    tr, va, te = build_direct_hf_sft_datasets(
        DirectHFSFTDatasetConfig(seq_length=SEQ, source=source, num_workers=0), hf_sft_tokenizer, (12, 4, 4), SEQ)
    assert (len(tr.docs), len(va.docs), len(te.docs)) == (12, 4, 4)
    assert [va.samples[i] for i in range(4)] == [0, 1, 2, 3]  # evaluation reads in order
    # explicit test_source (its own split), do_validation=False
    other = HFDatasetSourceConfig(path_or_dataset=path, split="validation")
    tr2, va2, te2 = build_direct_hf_sft_datasets(
        DirectHFSFTDatasetConfig(seq_length=SEQ, source=source, test_source=other, do_validation=False, num_workers=0),
        hf_sft_tokenizer, (12, 4, 4), SEQ)
    assert va2 is None and [d[0].tolist() for d in te2.docs] == [d[0].tolist() for d in va.docs]
    # padding: the longest sample rounded up to pad_to_multiple_of (capped at seq_length), or seq_length
    batch = [tr[i] for i in range(4)]
    longest = max(s["tokens"].numel() for s in batch)
    tight = build_direct_hf_sft_datasets(DirectHFSFTDatasetConfig(seq_length=SEQ, source=source, num_workers=0,
                                                                  pad_to_multiple_of=16), hf_sft_tokenizer,
                                         (12, 0, 0), SEQ)[0]
    full = build_direct_hf_sft_datasets(DirectHFSFTDatasetConfig(seq_length=SEQ, source=source, num_workers=0,
                                                                 pad_to_max_length=True), hf_sft_tokenizer,
                                        (12, 0, 0), SEQ)[0]
    assert tight.collate_fn(batch)["tokens"].shape[1] == -(-longest // 16) * 16 < SEQ
    assert full.collate_fn(batch)["tokens"].shape[1] == SEQ
    assert tr.collate_fn(batch)["tokens"].shape[1] == SEQ  # 128 rounds up past seq_length: capped
