"""Which tokens of a rendered chat carry the loss: Megatron Bridge's chat loss modes and the ``<think>`` switch.

The chat formatter (``formatting.ChatFormatter``) finds each assistant turn's character span in the rendered
conversation; this module turns those spans into the per-token loss flags:

- ``loss_mode='assistant'``: every assistant turn (tool-call turns included; tool results, system and user
  turns never), as transformers' ``return_assistant_tokens_mask`` marks ``{% generation %}`` blocks.
- ``loss_mode='last_turn'``: only the last assistant message of the conversation.
- ``loss_mode='full'``: every rendered token (system, user and tool turns too). Padding is never trained.

In every mode the turn-start control tokens Bridge never trains on (``NEVER_TRAINED_TOKENS``: ChatML's
``<|im_start|>``, Llama 3's ``<|begin_of_text|>``/``<|start_header_id|>``/``<|end_header_id|>``, ...) are left
out when the tokenizer has them as single tokens. With ``train_on_think=False``, ``<think>...</think>`` spans
inside assistant turns (tags included; an unclosed one runs to the end of its turn) stay in the input but leave
the loss.
"""

from __future__ import annotations

import json
from typing import Any, Optional, Sequence

import numpy as np

from longspan.core.errors import DataError

LOSS_MODES = ("assistant", "last_turn", "full")

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

# Bridge's chat skip list (megatron.bridge.data.token_utils): role headers, BOS and pad/media placeholders. The
# assistant's end-of-turn tokens are not in it: the model must learn to stop.
NEVER_TRAINED_TOKENS = (
    "<|im_start|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
    "<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>",
    "<image>", "<pad>",
    "<|begin_of_text|>", "<|finetune_right_pad_id|>", "<|step_id|>", "<|start_header_id|>", "<|end_header_id|>",
    "<|python_tag|>", "<|image|>",
    "<image_soft_token>", "<audio_soft_token>", "<start_of_audio>", "<start_of_image>", "<end_of_audio>",
    "<end_of_image>",
)


def single_token_id(tokenizer: Any, text: str) -> Optional[int]:
    """The id of ``text`` when the tokenizer has it as one token, else None."""
    ids = list(tokenizer.tokenize(text))
    if len(ids) != 1:
        return None
    token_text = getattr(tokenizer, "token_text", None)
    found = token_text(ids[0]) if callable(token_text) else tokenizer.detokenize(ids)
    return ids[0] if found == text else None


def never_trained_ids(tokenizer: Any) -> frozenset[int]:
    """Ids of the ``NEVER_TRAINED_TOKENS`` this tokenizer has."""
    found = (single_token_id(tokenizer, text) for text in NEVER_TRAINED_TOKENS)
    return frozenset(tid for tid in found if tid is not None)


#: the roles chat templates render (OpenAI's, transformers' tool role, Llama 3.1's ipython)
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "ipython")


def normalize_messages(messages: Any, key: str, where: str) -> list[dict[str, Any]]:
    """Check the chat messages and prepare them for the template as Bridge does: a null ``content`` becomes
    ``""`` and JSON-string tool-call ``arguments`` become objects (templates render them with ``tojson``).
    A role outside ``CHAT_ROLES`` is a one-line DataError naming it (a template would drop or mangle it)."""
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in messages
    ):
        raise DataError(f"{where}: {key!r} must be a list of {{\"role\", \"content\"}} objects")
    for number, message in enumerate(messages):
        if message["role"] not in CHAT_ROLES:
            raise DataError(f"{where}: message {number} has role {message['role']!r}; valid roles: "
                            f"{', '.join(CHAT_ROLES)}")
    out = []
    for message in messages:
        message = dict(message)
        if message["content"] is None:
            message["content"] = ""
        if isinstance(message.get("tool_calls"), list):
            message["tool_calls"] = [_parsed_tool_call(call, where) for call in message["tool_calls"]]
        out.append(message)
    return out


def _parsed_tool_call(call: Any, where: str) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except json.JSONDecodeError:
        arguments = None
    if not isinstance(arguments, dict):
        raise DataError(f"{where}: tool call {function.get('name')!r} has arguments that are not a JSON object: "
                        f"{function['arguments']!r}")
    return {**call, "function": {**function, "arguments": arguments}}


def think_spans(text: str, start: int, end: int) -> list[tuple[int, int]]:
    """Character spans ``<think>...</think>`` (tags included) inside ``text[start:end]``."""
    spans = []
    at = text.find(THINK_OPEN, start, end)
    while at >= 0:
        close = text.find(THINK_CLOSE, at + len(THINK_OPEN), end)
        stop = end if close < 0 else close + len(THINK_CLOSE)
        spans.append((at, stop))
        at = text.find(THINK_OPEN, stop, end)
    return spans


def tokens_overlapping(offsets: Sequence[tuple[int, int]], start: int, end: int) -> tuple[int, int]:
    """Token indices [first, last) of the tokens whose characters overlap ``[start, end)``."""
    first = next((i for i, (_, e) in enumerate(offsets) if e > start), len(offsets))
    last = first
    while last < len(offsets) and offsets[last][0] < end:
        last += 1
    return first, last


def loss_flags(n_tokens: int, loss_mode: str, trained: Sequence[tuple[int, int]],
               untrained: Sequence[tuple[int, int]], ids: Sequence[int], never: frozenset[int]) -> np.ndarray:
    """0/1 per token: ones on ``trained`` token ranges (everything for 'full'), zeros on ``untrained`` ranges
    (think spans) and on ``never`` ids."""
    flags = np.ones(n_tokens, dtype=np.int8) if loss_mode == "full" else np.zeros(n_tokens, dtype=np.int8)
    for start, end in trained:
        flags[start:end] = 1
    for start, end in untrained:
        flags[start:end] = 0
    if never:
        flags[np.isin(np.asarray(ids, dtype=np.int64), np.fromiter(never, dtype=np.int64))] = 0
    return flags
