"""Schema adapters: rows in the shapes TRL, ShareGPT, Alpaca and plain-text corpora use -> one canonical record.

The canonical record is ``{"messages": [{"role", "content", ...}, ...]}`` (OpenAI style, rendered by the chat
template in ``longspan.data.sft.formatting.ChatFormatter``) or ``{"text": str}`` (plain text, every token
trained on). System prompts and multi-turn conversations are kept; other message keys (``tool_calls``,
``tool_call_id``, ``name``, ``reasoning_content``, ...) pass through to the template unchanged. Keys whose
value is null are dropped: Arrow-backed sources fill every message with every key any row has, and a template
that asks ``message.tool_calls is defined`` must see the same message whatever file format it came from.

``ADAPTERS`` is the table: name -> (columns that identify it, the function). ``detect_adapter`` picks the one
whose columns a dataset has when exactly one matches; ``adapter_kwargs`` rename columns
(``messages_column``, ``conversation_column``, ``instruction_column``, ``input_column``, ``output_column``,
``system_column``, ``prompt_column``, ``completion_column``, ``text_column``) and ``system_prompt`` adds a
system turn to conversations that have none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from longspan.config.schema.data_hf import SCHEMA_ADAPTERS
from longspan.core.errors import ConfigError

# ShareGPT's speaker names -> OpenAI roles
SHAREGPT_ROLES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "model": "assistant", "chatgpt": "assistant",
    "function_call": "assistant",
    "system": "system",
    "tool": "tool", "observation": "tool", "function_response": "tool", "ipython": "tool",
}


class RowError(ValueError):
    """A row that no adapter can read; the message is the reason (the caller adds file and row)."""


def _column(kwargs: dict[str, Any], name: str, default: str) -> str:
    return str(kwargs.get(f"{name}_column", default))


def _clean_message(message: Any, index: int) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise RowError(f"message {index} is a {type(message).__name__}, not a mapping")
    out = {k: v for k, v in message.items() if v is not None or k == "content"}
    if not isinstance(out.get("role"), str):
        raise RowError(f"message {index} has no 'role'")
    if "content" not in out:
        out["content"] = None
    if out["content"] is None and not out.get("tool_calls"):
        raise RowError(f"message {index} ({out['role']}) has no content")
    return out


def _with_system(messages: list[dict[str, Any]], kwargs: dict[str, Any]) -> list[dict[str, Any]]:
    system = kwargs.get("system_prompt")
    if system and not (messages and messages[0]["role"] == "system"):
        return [{"role": "system", "content": str(system)}] + messages
    return messages


def _chat_record(messages: list[dict[str, Any]], kwargs: dict[str, Any]) -> dict[str, Any]:
    messages = _with_system(messages, kwargs)
    if not any(m["role"] == "assistant" for m in messages):
        raise RowError("the conversation has no assistant turn, so nothing would be trained on")
    return {"messages": messages}


def _messages_list(value: Any, column: str) -> list[Any]:
    if not isinstance(value, list) or not value:
        raise RowError(f"column {column!r} is {'empty' if isinstance(value, list) else type(value).__name__}, "
                       "not a list of messages")
    return value


def adapt_messages(row: dict[str, Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """OpenAI ``messages``: [{"role", "content", ...}]."""
    column = _column(kwargs, "messages", "messages")
    value = _messages_list(row.get(column), column)
    return _chat_record([_clean_message(m, i) for i, m in enumerate(value)], kwargs)


def _sharegpt_message(message: Any, index: int) -> dict[str, Any]:
    if isinstance(message, dict) and "from" in message and message.get("from") is not None:
        speaker = str(message["from"]).lower()
        if speaker not in SHAREGPT_ROLES:
            raise RowError(f"message {index} is from {message['from']!r}: use one of {sorted(SHAREGPT_ROLES)}")
        rest = {k: v for k, v in message.items() if k not in ("from", "value", "role", "content")}
        return _clean_message({"role": SHAREGPT_ROLES[speaker], "content": message.get("value"), **rest}, index)
    return _clean_message(message, index)


def adapt_conversation(row: dict[str, Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """``conversation`` / ``conversations``: ShareGPT turns ({"from", "value"}) or OpenAI messages."""
    names = [kwargs["conversation_column"]] if "conversation_column" in kwargs else ["conversations", "conversation"]
    column = next((n for n in names if row.get(n) is not None), names[0])
    value = _messages_list(row.get(column), column)
    return _chat_record([_sharegpt_message(m, i) for i, m in enumerate(value)], kwargs)


def _text(row: dict[str, Any], column: str, required: bool = True) -> str:
    value = row.get(column)
    if value is None:
        if required:
            raise RowError(f"column {column!r} is missing or null")
        return ""
    if not isinstance(value, str):
        raise RowError(f"column {column!r} is a {type(value).__name__}, not text")
    return value


def adapt_alpaca(row: dict[str, Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Alpaca ``instruction`` / ``input`` / ``output`` (and an optional ``system``): one user and one assistant
    turn; a non-empty input follows the instruction after a blank line."""
    instruction = _text(row, _column(kwargs, "instruction", "instruction"))
    extra = _text(row, _column(kwargs, "input", "input"), required=False)
    output = _text(row, _column(kwargs, "output", "output"))
    system = _text(row, _column(kwargs, "system", "system"), required=False)
    prompt = f"{instruction}\n\n{extra}" if extra.strip() else instruction
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": prompt}, {"role": "assistant", "content": output}]
    return _chat_record(messages, kwargs)


def adapt_prompt_completion(row: dict[str, Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """TRL ``prompt`` / ``completion``: text (a user turn and an assistant turn) or TRL's conversational form
    (lists of messages)."""
    prompt_column = _column(kwargs, "prompt", "prompt")
    completion_column = _column(kwargs, "completion", "completion")
    prompt, completion = row.get(prompt_column), row.get(completion_column)
    if isinstance(prompt, list) or isinstance(completion, list):
        prompt_messages = [_clean_message(m, i) for i, m in enumerate(_messages_list(prompt, prompt_column))]
        completion_messages = [_clean_message(m, len(prompt_messages) + i)
                               for i, m in enumerate(_messages_list(completion, completion_column))]
        return _chat_record(prompt_messages + completion_messages, kwargs)
    messages = [{"role": "user", "content": _text(row, prompt_column)},
                {"role": "assistant", "content": _text(row, completion_column)}]
    return _chat_record(messages, kwargs)


def adapt_text(row: dict[str, Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Plain ``text``: tokenized as it is, every token trained on."""
    text = _text(row, _column(kwargs, "text", "text"))
    if not text.strip():
        raise RowError("the text is empty")
    return {"text": text}


@dataclass(frozen=True)
class Adapter:
    """One schema: the column sets that identify it (any one of them) and the row function."""

    columns: tuple[tuple[str, ...], ...]
    adapt: Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]]


ADAPTERS: dict[str, Adapter] = {
    "messages": Adapter((("messages",),), adapt_messages),
    "conversation": Adapter((("conversations",), ("conversation",)), adapt_conversation),
    "sharegpt": Adapter((), adapt_conversation),  # the same rows, named by their origin; never auto-detected
    "alpaca": Adapter((("instruction", "output"),), adapt_alpaca),
    "prompt_completion": Adapter((("prompt", "completion"),), adapt_prompt_completion),
    "text": Adapter((("text",),), adapt_text),
}
assert tuple(ADAPTERS) == SCHEMA_ADAPTERS, "the config's adapter names and this table must agree"


def detect_adapter(columns: list[str], adapter_kwargs: Optional[dict[str, Any]], where: str) -> str:
    """The adapter whose columns ``columns`` has, when exactly one matches (renamed columns count)."""
    kwargs = adapter_kwargs or {}
    present = set(columns)
    renamed = {v: k[: -len("_column")] for k, v in kwargs.items() if k.endswith("_column") and isinstance(v, str)}
    present |= {renamed[c] for c in columns if c in renamed}
    matches = [name for name, adapter in ADAPTERS.items()
               if any(all(c in present for c in group) for group in adapter.columns)]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise ConfigError(
            f"{where}: columns {sorted(columns)} match no known schema (messages; conversation(s); instruction + "
            "output; prompt + completion; text): set schema_adapter and adapter_kwargs column names"
        )
    raise ConfigError(
        f"{where}: columns {sorted(columns)} match several schemas ({', '.join(matches)}): set schema_adapter"
    )


def adapt_row(adapter: str, row: dict[str, Any], adapter_kwargs: Optional[dict[str, Any]]) -> dict[str, Any]:
    """The canonical record of one row (``RowError`` with the reason when the row does not fit)."""
    return ADAPTERS[adapter].adapt(row, dict(adapter_kwargs or {}))
