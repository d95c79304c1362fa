"""Loss masks of SFT records: prompt/completion (Bridge's template semantics) and chat (two real templates).

Oracle for chat: transformers' ``apply_chat_template`` — the rendered text must be identical, and the
assistant-token mask transformers computes from ``{% generation %}`` markers (placed in a marked copy of each
template) must equal longspan's mask computed from the unmarked template.
"""

from __future__ import annotations

import numpy as np
import pytest
from transformers import AutoTokenizer

from longspan.core.errors import ConfigError, DataError, NotSupportedError
from longspan.data.sft.formatting import RecordFormatter, parse_format_options
from tests.data.sft.conftest import (
    CHATML_TEMPLATE,
    CHATML_TEMPLATE_MARKED,
    LLAMA3_TEMPLATE,
    LLAMA3_TEMPLATE_MARKED,
    REWRITING_TEMPLATE,
)

CONVERSATION = [
    {"role": "user", "content": "hello world, how are you today?"},
    {"role": "assistant", "content": "the quick brown fox"},
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant", "content": "It is four."},
]


def _formatter(tokenizer, template=None, max_ids=512, **kwargs):
    return RecordFormatter(tokenizer, parse_format_options(kwargs), max_ids, template)


def test_prompt_completion_masks_exactly_the_completion_and_eos(tokenizer):
    fmt = _formatter(tokenizer)
    ids, flags = fmt({"input": "What is two plus two?", "output": "It is four."}, "rec")
    prompt = tokenizer.tokenize("What is two plus two?") + tokenizer.tokenize(" ")
    answer = tokenizer.tokenize("It is four.")
    assert ids.tolist() == prompt + answer + [tokenizer.eos]
    assert flags.tolist() == [0] * len(prompt) + [1] * (len(answer) + 1)


def test_prompt_template_keys_bos_and_no_eos(tokenizer):
    fmt = _formatter(tokenizer, prompt_template="Q: {question}\nA: {answer}", label_key="answer",
                     truncation_field="question", add_bos=True, add_eos=False)
    ids, flags = fmt({"question": "hello world", "answer": "lazy dog"}, "rec")
    ctx = [tokenizer.bos] + tokenizer.tokenize("Q: ") + tokenizer.tokenize("hello world") + tokenizer.tokenize("\nA: ")
    ans = tokenizer.tokenize("lazy dog")
    assert ids.tolist() == ctx + ans
    assert flags.tolist() == [0] * len(ctx) + [1] * len(ans)


@pytest.mark.parametrize("method", ["right", "left"])
def test_truncation_cuts_the_truncation_field_on_its_side(tokenizer, method):
    question = "the quick brown fox jumps over the lazy dog"
    q_ids = tokenizer.tokenize(question)
    a_ids = tokenizer.tokenize("stone")
    sep = tokenizer.tokenize(" ")
    max_ids = len(q_ids) + len(sep) + len(a_ids) + 1 - 3  # three tokens too many
    fmt = _formatter(tokenizer, max_ids=max_ids, truncation_method=method)
    ids, flags = fmt({"input": question, "output": "stone"}, "rec")
    kept = q_ids[:-3] if method == "right" else q_ids[3:]
    assert ids.tolist() == kept + sep + a_ids + [tokenizer.eos]
    assert int(flags.sum()) == len(a_ids) + 1


def test_answer_only_loss_false_trains_on_everything(tokenizer):
    ids, flags = _formatter(tokenizer, answer_only_loss=False)({"input": "hello", "output": "world"}, "rec")
    assert flags.tolist() == [1] * len(ids)


@pytest.mark.parametrize("template,marked", [(CHATML_TEMPLATE, CHATML_TEMPLATE_MARKED),
                                             (LLAMA3_TEMPLATE, LLAMA3_TEMPLATE_MARKED)],
                         ids=["chatml", "llama3"])
@pytest.mark.parametrize("conversation", [CONVERSATION, [{"role": "system", "content": "be brief"}] + CONVERSATION[:2]])
def test_chat_mask_is_exactly_the_assistant_tokens(tokenizer, hf_tokenizer_dir, template, marked, conversation):
    hf = AutoTokenizer.from_pretrained(hf_tokenizer_dir)
    fmt = _formatter(tokenizer, template)
    text = hf.apply_chat_template(conversation, tokenize=False, chat_template=template)
    assert fmt.chat.render(conversation, False, "rec") == text
    ids, flags = fmt({"messages": conversation}, "rec")
    oracle = hf.apply_chat_template(conversation, chat_template=marked, return_dict=True,
                                    return_assistant_tokens_mask=True, tokenize=True)
    assert ids.tolist() == list(oracle["input_ids"])
    assert flags.tolist() == list(oracle["assistant_masks"])
    # uneven: the two templates and conversations put the assistant tokens in different places
    assert 0 < flags.sum() < len(flags)
    decoded = tokenizer.detokenize(ids[flags == 1].tolist())
    for m in conversation:
        assert (m["content"] in decoded) == (m["role"] == "assistant")


def test_chat_template_from_the_tokenizer_and_from_config(tokenizer):
    ids_default, _ = _formatter(tokenizer)({"messages": CONVERSATION}, "rec")  # the tokenizer ships ChatML
    assert tokenizer.chat_template() == CHATML_TEMPLATE
    ids_llama, _ = _formatter(tokenizer, LLAMA3_TEMPLATE)({"messages": CONVERSATION}, "rec")
    assert ids_default.tolist() != ids_llama.tolist()
    assert ids_llama[0] == tokenizer.bos


def test_chat_errors_are_one_line_data_errors(tokenizer):
    fmt = _formatter(tokenizer)
    with pytest.raises(DataError, match="no assistant turn"):
        fmt({"messages": [{"role": "user", "content": "hi"}]}, "f.jsonl line 3")
    with pytest.raises(DataError, match="list of"):
        fmt({"messages": "hi"}, "rec")
    bot = [{"role": "user", "content": "hi"}, {"role": "bot", "content": "hello"}]  # not "no assistant turn"
    with pytest.raises(DataError, match=r"^f.jsonl line 4: message 1 has role 'bot'; valid roles: system, "
                                        r"developer, user, assistant, tool, ipython$"):
        fmt({"messages": bot}, "f.jsonl line 4")
    with pytest.raises(DataError, match="rewrites earlier turns"):
        _formatter(tokenizer, REWRITING_TEMPLATE)({"messages": CONVERSATION}, "rec")
    with pytest.raises(DataError, match="no 'output' key"):
        fmt({"input": "x"}, "rec")


def test_chat_without_a_template_is_a_data_error(tmp_path):
    from longspan.data.tokenizers import HuggingFaceTokenizer
    from tests.data.sft.conftest import make_hf_tokenizer_dir

    tok = HuggingFaceTokenizer(make_hf_tokenizer_dir(str(tmp_path / "t"), chat_template=None))
    with pytest.raises(DataError, match="tokenizer.chat_template"):
        _formatter(tok)({"messages": CONVERSATION}, "rec")
    ids, flags = _formatter(tok, CHATML_TEMPLATE)({"messages": CONVERSATION}, "rec")
    assert flags.sum() > 0


def test_bad_dataset_kwargs_are_rejected():
    with pytest.raises(NotSupportedError, match="unsupported key"):
        parse_format_options({"promt_template": "{input}"})
    with pytest.raises(ConfigError, match="truncation_method"):
        parse_format_options({"truncation_method": "middle"})
    with pytest.raises(ConfigError, match="label_key"):
        parse_format_options({"prompt_template": "{input}"})
    with pytest.raises(ConfigError, match="truncation_field"):
        parse_format_options({"truncation_field": "context"})


def test_chat_truncation_keeps_the_first_tokens(tokenizer):
    full_ids, full_flags = _formatter(tokenizer)({"messages": CONVERSATION}, "rec")
    ids, flags = _formatter(tokenizer, max_ids=20)({"messages": CONVERSATION}, "rec")
    assert ids.tolist() == full_ids[:20].tolist() and np.array_equal(flags, full_flags[:20])
