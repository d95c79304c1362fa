"""Chat loss modes (Bridge's ChatSFTPreprocessingConfig.loss_mode) and the ``train_on_think`` switch.

Oracle: transformers' ``apply_chat_template(..., return_assistant_tokens_mask=True)`` on a copy of each template
with ``{% generation %}`` markers; longspan formats with the unmarked template. Two templates written here: a
Qwen2.5-style ChatML one with tools and tool calls, and a Llama-3.1-style one with JSON tool calls and
``ipython`` tool results.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from transformers import AutoTokenizer

from longspan.core.errors import ConfigError, DataError
from longspan.data.sft.formatting import RecordFormatter, SFTFormatOptions, parse_format_options


def _qwen_template(marked: bool) -> str:
    gen, endgen = ("{% generation %}", "{% endgeneration %}") if marked else ("", "")
    return (
        "{% if tools %}{{ '<|im_start|>system\\n' }}{% if messages[0].role == 'system' %}{{ messages[0].content }}"
        "{% else %}{{ 'You are a helpful assistant.' }}{% endif %}{{ '\\n\\n# Tools\\n<tools>' }}"
        "{% for tool in tools %}{{ '\\n' + tool | tojson }}{% endfor %}{{ '\\n</tools><|im_end|>\\n' }}"
        "{% elif messages[0].role == 'system' %}{{ '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
        "{% else %}{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
        "{% for message in messages %}"
        "{% if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
        "{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
        "{% elif message.role == 'assistant' %}{{ '<|im_start|>assistant\\n' }}" + gen +
        "{{ message.content }}{% if message.tool_calls %}{% for call in message.tool_calls %}"
        "{% if not loop.first or message.content %}{{ '\\n' }}{% endif %}"
        "{{ '<tool_call>\\n{\"name\": \"' + call.function.name + '\", \"arguments\": ' }}"
        "{{ call.function.arguments | tojson }}{{ '}\\n</tool_call>' }}{% endfor %}{% endif %}"
        "{{ '<|im_end|>\\n' }}" + endgen +
        "{% elif message.role == 'tool' %}"
        "{% if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
        "{{ '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
        "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
        "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )


def _llama_template(marked: bool) -> str:
    gen, endgen = ("{% generation %}", "{% endgeneration %}") if marked else ("", "")
    return (
        "{{ bos_token }}{% if tools %}{{ '<|start_header_id|>system<|end_header_id|>\\n\\nEnvironment: ipython\\n' }}"
        "{% for tool in tools %}{{ tool | tojson + '\\n' }}{% endfor %}{{ '<|eot_id|>' }}{% endif %}"
        "{% for message in messages %}"
        "{% if message.role == 'assistant' %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}" + gen +
        "{% if message.tool_calls %}{% for call in message.tool_calls %}"
        "{{ '{\"name\": \"' + call.function.name + '\", \"parameters\": ' + call.function.arguments | tojson + '}' }}"
        "{% endfor %}{% else %}{{ message.content | trim }}{% endif %}{{ '<|eot_id|>' }}" + endgen +
        "{% elif message.role == 'tool' %}"
        "{{ '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}"
        "{% else %}{{ '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content | trim"
        " + '<|eot_id|>' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
    )


TEMPLATES = {"qwen": _qwen_template, "llama3": _llama_template}
# Bridge's skip list as it meets these templates: the turn-start tokens, never the end-of-turn ones
NEVER_TRAINED = {"qwen": {"<|im_start|>"}, "llama3": {"<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>"}}

MULTI_TURN = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hello world, how are you today?"},
    {"role": "assistant", "content": "the quick brown fox"},
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant", "content": "It is four."},
    {"role": "user", "content": "reverse the word: stone"},
    {"role": "assistant", "content": "enots"},
]
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "weather in a city",
                                                 "parameters": {"type": "object",
                                                                "properties": {"city": {"type": "string"}}}}}
TOOL_CALLS = {
    "tools": [WEATHER_TOOL],
    "messages": [
        {"role": "user", "content": "What is the weather in Paris and in Rome?"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny, 21 C"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
        {"role": "tool", "content": "rain, 12 C"},
        {"role": "assistant", "content": "Paris is sunny; Rome has rain."},
    ],
}
CONVERSATIONS = {"multi_turn": {"messages": MULTI_TURN}, "tool_calls": TOOL_CALLS}


@pytest.fixture(scope="module")
def hf(hf_tokenizer_dir):
    return AutoTokenizer.from_pretrained(hf_tokenizer_dir)


def _format(tokenizer, template, record, max_ids=1024, **kwargs):
    return RecordFormatter(tokenizer, parse_format_options(kwargs), max_ids, template)(record, "rec")


def _oracle(hf, name, record):
    """(ids, transformers' assistant-token mask) from the marked template."""
    out = hf.apply_chat_template(record["messages"], tools=record.get("tools"), chat_template=TEMPLATES[name](True),
                                 tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    return list(out["input_ids"]), np.asarray(out["assistant_masks"], dtype=np.int8)


def _last_span(mask: np.ndarray) -> np.ndarray:
    """The mask restricted to its last contiguous run of ones."""
    start = len(mask) - int(np.argmax(mask[::-1] == 1))
    while start > 0 and mask[start - 1] == 1:
        start -= 1
    out = np.zeros_like(mask)
    out[start:] = mask[start:]
    return out


@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_loss_modes_equal_transformers_assistant_masks(tokenizer, hf, name, conversation):
    record = CONVERSATIONS[conversation]
    oracle_ids, oracle_mask = _oracle(hf, name, record)
    text = hf.apply_chat_template(record["messages"], tools=record.get("tools"), tokenize=False,
                                  chat_template=TEMPLATES[name](False))
    never = np.isin(oracle_ids, hf.convert_tokens_to_ids(sorted(NEVER_TRAINED[name])))
    expected = {"assistant": oracle_mask, "last_turn": _last_span(oracle_mask), "full": (~never).astype(np.int8)}
    got = {}
    for mode in ("assistant", "last_turn", "full"):
        ids, flags = _format(tokenizer, TEMPLATES[name](False), record, loss_mode=mode)
        assert ids.tolist() == oracle_ids and tokenizer.detokenize(ids.tolist()) == text
        assert flags.tolist() == expected[mode].tolist(), mode
        got[mode] = flags
    # uneven, and each mode strictly inside the next
    assert 0 < got["last_turn"].sum() < got["assistant"].sum() < got["full"].sum() < len(oracle_ids)
    assert np.all(got["last_turn"] <= got["assistant"]) and np.all(got["assistant"] <= got["full"])
    trained = tokenizer.detokenize(np.asarray(oracle_ids)[got["assistant"] == 1].tolist())
    last = tokenizer.detokenize(np.asarray(oracle_ids)[got["last_turn"] == 1].tolist())
    assert last.startswith(record["messages"][-1]["content"]) and last in trained
    for message in record["messages"]:  # system, user and tool text never in 'assistant' mode
        if message["role"] != "assistant":
            assert message["content"] not in trained
    if conversation == "tool_calls":  # the assistant's tool-call turns are trained, the tool results are not
        assert trained.count("get_weather") == 2 and '"Rome"' in trained and "sunny, 21 C" not in trained
        full_text = tokenizer.detokenize(np.asarray(oracle_ids)[got["full"] == 1].tolist())
        assert "sunny, 21 C" in full_text and "get_weather" in full_text


def _think_record():
    return {"messages": [
        {"role": "user", "content": "What is two plus two? <think>user text stays</think>"},
        {"role": "assistant", "content": "<think>\nadd two and two</think>\n\nIt is four."},
        {"role": "user", "content": "reverse the word: stone"},
        {"role": "assistant", "content": "<think>read it backwards</think>enots"},
    ]}


def _think_token_mask(hf, text: str, in_assistant: np.ndarray) -> np.ndarray:
    """1 on tokens touching a <think>...</think> span of an assistant turn (transformers' offsets)."""
    offsets = hf(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    spans = [m.span() for m in re.finditer(r"<think>.*?</think>", text, flags=re.S)]
    touch = np.asarray([any(s < e2 and e > s2 for s2, e2 in spans) for s, e in offsets], dtype=bool)
    return (touch & (in_assistant == 1)).astype(np.int8)


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_think_spans_are_masked_but_kept_in_the_input(tokenizer, hf, name):
    record = _think_record()
    oracle_ids, oracle_mask = _oracle(hf, name, record)
    text = hf.apply_chat_template(record["messages"], tokenize=False, chat_template=TEMPLATES[name](False))
    think = _think_token_mask(hf, text, oracle_mask)
    assert think.sum() > 4
    for mode in ("assistant", "last_turn", "full"):
        ids_on, on = _format(tokenizer, TEMPLATES[name](False), record, loss_mode=mode)
        ids_off, off = _format(tokenizer, TEMPLATES[name](False), record, loss_mode=mode, train_on_think=False)
        assert ids_on.tolist() == ids_off.tolist() == oracle_ids  # the input keeps the thoughts
        assert off.tolist() == (on & (1 - think)).tolist(), mode
        assert off.sum() < on.sum()
    ids, off = _format(tokenizer, TEMPLATES[name](False), record, train_on_think=False)
    trained = tokenizer.detokenize(ids[off == 1].tolist())
    assert "add two" not in trained and "backwards" not in trained and "think>" not in trained
    assert "It is four." in trained and "enots" in trained
    _, full_off = _format(tokenizer, TEMPLATES[name](False), record, loss_mode="full", train_on_think=False)
    assert "user text stays" in tokenizer.detokenize(ids[full_off == 1].tolist())  # only assistant thoughts go


def test_masks_without_token_offsets_match(tokenizer):
    """A tokenizer without ``tokenize_with_offsets`` finds the same turns and think spans by prefix tokenizing."""

    class NoOffsets:
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            if name == "tokenize_with_offsets":
                raise AttributeError(name)
            return getattr(self.inner, name)

    for record in (_think_record(), TOOL_CALLS):
        for mode in ("assistant", "last_turn", "full"):
            a = _format(tokenizer, _qwen_template(False), record, loss_mode=mode, train_on_think=False)
            b = _format(NoOffsets(tokenizer), _qwen_template(False), record, loss_mode=mode, train_on_think=False)
            assert a[0].tolist() == b[0].tolist() and a[1].tolist() == b[1].tolist()


@pytest.mark.parametrize("mode", ["assistant", "last_turn", "full"])
def test_truncation_keeps_the_first_tokens_in_every_mode(tokenizer, mode):
    full_ids, full_flags = _format(tokenizer, _qwen_template(False), TOOL_CALLS, loss_mode=mode)
    for max_ids in (17, 60, len(full_ids) - 3):
        ids, flags = _format(tokenizer, _qwen_template(False), TOOL_CALLS, max_ids=max_ids, loss_mode=mode)
        assert ids.tolist() == full_ids[:max_ids].tolist() and flags.tolist() == full_flags[:max_ids].tolist()
    # cut before the last assistant turn: nothing left to train on in 'last_turn', the earlier turns in 'assistant'
    _, assistant = _format(tokenizer, _qwen_template(False), TOOL_CALLS, loss_mode="assistant")
    before_last = int(np.flatnonzero(_last_span(assistant))[0]) - 1
    _, cut = _format(tokenizer, _qwen_template(False), TOOL_CALLS, max_ids=before_last, loss_mode=mode)
    assert (cut.sum() == 0) == (mode == "last_turn")


def test_string_tool_arguments_and_null_content_render_like_objects(tokenizer):
    record = {"tools": TOOL_CALLS["tools"], "messages": [dict(m) for m in TOOL_CALLS["messages"]]}
    for m in record["messages"]:
        if m.get("tool_calls"):
            m["content"] = None
            m["tool_calls"] = [{"type": "function", "function": {
                "name": c["function"]["name"], "arguments": json.dumps(c["function"]["arguments"])}}
                for c in m["tool_calls"]]
    a = _format(tokenizer, _qwen_template(False), TOOL_CALLS)
    b = _format(tokenizer, _qwen_template(False), record)
    assert a[0].tolist() == b[0].tolist() and a[1].tolist() == b[1].tolist()
    record["messages"][1]["tool_calls"][0]["function"]["arguments"] = "[1, 2]"
    with pytest.raises(DataError, match="not a JSON object"):
        _format(tokenizer, _qwen_template(False), record)


def test_full_mode_trains_a_conversation_without_assistant_turns(tokenizer):
    record = {"messages": [{"role": "user", "content": "hello world"}]}
    ids, flags = _format(tokenizer, _qwen_template(False), record, loss_mode="full")
    assert 0 < flags.sum() < len(ids)
    with pytest.raises(DataError, match="no assistant turn"):
        _format(tokenizer, _qwen_template(False), record, loss_mode="last_turn")


def test_bad_loss_options_are_one_line_config_errors():
    cases = [({"loss_mode": "last"}, r"loss_mode='last': use one of \['assistant', 'last_turn', 'full'\]"),
             ({"train_on_think": "no"}, "train_on_think='no'"),
             ({"answer_only_loss": False, "loss_mode": "last_turn"}, "use loss_mode='full'"),
             ({"answer_only_loss": False, "train_on_think": False}, "answer_only_loss=False"),
             ({"chat": False, "loss_mode": "full"}, "applies to chat records")]
    for kwargs, message in cases:
        with pytest.raises(ConfigError, match=message) as info:
            parse_format_options(kwargs)
        assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="loss_mode='everything'"):
        SFTFormatOptions(loss_mode="everything")  # built directly, as the HF-dataset configs do
    opts = parse_format_options({"loss_mode": "last_turn", "train_on_think": False})
    assert (opts.loss_mode, opts.train_on_think) == ("last_turn", False)


def test_dataset_kwargs_reach_the_finetuning_dataset(tmp_path, tokenizer):
    from longspan.config.schema.data import FinetuningDatasetConfig
    from longspan.data.sft.dataset import build_sft_datasets
    from tests.data.sft.conftest import write_jsonl

    write_jsonl(str(tmp_path / "training.jsonl"), [_think_record()] * 3)
    trained = {}
    for kwargs in ({}, {"loss_mode": "last_turn"}, {"loss_mode": "last_turn", "train_on_think": False}):
        cfg = FinetuningDatasetConfig(dataset_root=str(tmp_path), seq_length=256, do_validation=False,
                                      dataset_kwargs=kwargs)
        train = build_sft_datasets(cfg, tokenizer, (2, 0, 0), 256, _qwen_template(False))[0]
        sample = train[0]
        trained[len(trained)] = tokenizer.detokenize(sample["labels"][sample["loss_mask"] > 0].tolist())
    assert trained[0].startswith("<think>\nadd two and two</think>\n\nIt is four.<|im_end|>\n")
    assert trained[1] == "<think>read it backwards</think>enots<|im_end|>\n"
    assert trained[2] == "enots<|im_end|>\n"
