"""Fixtures of the SFT data tests: a tiny BPE tokenizer (trained with ``tokenizers``, saved as a transformers
``PreTrainedTokenizerFast`` directory), two real chat templates written out, and JSONL writers."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from tests.parallel.conftest import pool2, pool4  # noqa: F401

# Qwen2 / ChatML style (default system prompt when the conversation has none)
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# The same template with transformers' generation markers around each assistant reply (the oracle's mask)
CHATML_TEMPLATE_MARKED = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}{% generation %}"
    "{{ message['content'] + '<|im_end|>' + '\\n' }}{% endgeneration %}"
    "{% else %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Llama-3-Instruct
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim"
    " + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
LLAMA3_TEMPLATE_MARKED = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% if loop.index0 == 0 %}{{ bos_token }}{% endif %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim + '<|eot_id|>' }}"
    "{% endgeneration %}{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
# A template that rewrites earlier assistant turns (as reasoning templates drop old thoughts)
REWRITING_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'assistant' and not loop.last %}"
    "{{ '<|im_start|>assistant\\n[earlier]<|im_end|>\\n' }}{% else %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

SPECIALS = ["<|endoftext|>", "<pad>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>"]

CORPUS = [
    "the quick brown fox jumps over the lazy dog", "hello world, how are you today?",
    "reverse the word: stone -> enots", "What is two plus two? It is four.", "You are a helpful assistant.",
    "system user assistant question answer", "lorem ipsum dolor sit amet consectetur adipiscing elit",
] * 20


def make_hf_tokenizer_dir(path: str, chat_template: str | None = CHATML_TEMPLATE, vocab_size: int = 320) -> str:
    """Train a byte-level BPE tokenizer and save it as a transformers PreTrainedTokenizerFast directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<pad>",
                                 bos_token="<|begin_of_text|>")
    if chat_template is not None:
        hf.chat_template = chat_template
    hf.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def hf_tokenizer_dir(tmp_path_factory) -> str:
    return make_hf_tokenizer_dir(str(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="session")
def tokenizer(hf_tokenizer_dir):
    from longspan.data.tokenizers import HuggingFaceTokenizer

    return HuggingFaceTokenizer(hf_tokenizer_dir)


def write_jsonl(path: str, records: list[Any]) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path


def qa_records(n: int, seed: int = 0, skew: bool = False) -> list[dict[str, str]]:
    """Prompt/completion records of uneven lengths (``skew``: many short, a few long)."""
    import random

    rng = random.Random(seed)
    words = "the quick brown fox jumps over lazy dog hello world stone".split()
    out = []
    for i in range(n):
        long = skew and rng.random() < 0.1
        q = " ".join(rng.choice(words) for _ in range(rng.randint(8, 20) if long else rng.randint(1, 4)))
        a = " ".join(rng.choice(words) for _ in range(rng.randint(6, 14) if long else rng.randint(1, 3)))
        out.append({"input": q, "output": a})
    return out
