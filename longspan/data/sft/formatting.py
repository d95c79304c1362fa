"""Turning one SFT record into token ids and a per-token loss flag.

Two record kinds (Megatron Bridge's GPT SFT datasets):

- **prompt/completion** ``{"input": ..., "output": ...}``: the record's fields are put into ``prompt_template``
  (default ``"{input} {output}"``); everything from the ``label_key`` field on is the completion and carries the
  loss, together with the EOS token; the text before it is context only. Each piece of the template is
  tokenized on its own (as Bridge does), so a too-long ``truncation_field`` can be cut by tokens.
- **chat** ``{"messages": [{"role": ..., "content": ...}, ...]}``: rendered with the chat template (the
  ``tokenizer.chat_template`` config field, else the tokenizer's own; a record's ``tools`` go to the template as
  ``tools``). The loss covers the assistant turns, the last one only or every token as ``loss_mode`` says, and
  ``train_on_think=False`` takes ``<think>`` spans out of it (``chat_loss``). Assistant turns (tool-call turns
  included) are found without relying on ``{% generation %}`` markers: for the k-th assistant message the
  conversation before it is rendered with the generation prompt, and the conversation up to and including it
  without; the tokens between the two renders are that turn. Both renders must be prefixes of the full render
  (in text and in tokens), otherwise the template rewrites history (or tokenization merges across turns) and
  the record stops with a one-line ``DataError``: the prompts are never trained on silently.

Every formatter returns ``(ids, in_loss)``: token ids and a 0/1 flag per id saying whether the model is
trained to *produce* that id. The dataset turns them into ``tokens = ids[:-1]``, ``labels = ids[1:]``,
``loss_mask = in_loss[1:]``.
"""

from __future__ import annotations

import json
import math
import re
import string
from dataclasses import dataclass, fields, replace
from datetime import datetime
from functools import lru_cache
from typing import Any, Callable, Optional

import numpy as np

from longspan.core.errors import ConfigError, DataError, NotSupportedError
from longspan.data.sft.chat_loss import (
    LOSS_MODES,
    loss_flags,
    never_trained_ids,
    normalize_messages,
    think_spans,
    tokens_overlapping,
)


@dataclass
class SFTFormatOptions:
    """The ``dataset.dataset_kwargs`` keys longspan reads (Megatron Bridge's GPT SFT dataset arguments)."""

    prompt_template: str = "{input} {output}"
    """Template with one ``{key}`` per record field; everything from ``{label_key}`` on is the completion."""

    label_key: str = "output"
    """Record field holding the completion (the part trained on)."""

    truncation_field: str = "input"
    """Comma-separated record fields shortened (in this order) when a sample is longer than seq_length."""

    truncation_method: str = "right"
    """'right' drops tokens at the end of the truncated field, 'left' at its start."""

    add_bos: bool = False
    """Prepend the tokenizer's BOS token (prompt/completion records)."""

    add_eos: bool = True
    """Append the tokenizer's EOS token, trained on with the completion (prompt/completion records)."""

    answer_only_loss: bool = True
    """Loss only on the completion (assistant turns); False trains on every token of the sample."""

    pad_to_max_length: Optional[bool] = None
    """True: pad every microbatch to seq_length; False: to the longest sample of the microbatch, rounded up to
    pad_seq_length_to_mult; None (unset): True under pipeline parallel (its stages exchange fixed shapes), else
    False (``resolve_padding``). Packed data is not padded per microbatch either way."""

    pad_seq_length_to_mult: int = 16
    """With pad_to_max_length=False: microbatch lengths are multiples of this (use a multiple of
    2 x context_parallel_size under context parallel)."""

    chat: Optional[bool] = None
    """True: every record is a chat record; False: prompt/completion; None: by the record ('messages' key)."""

    messages_key: str = "messages"
    """Record field holding the chat messages."""

    loss_mode: str = "assistant"
    """Chat records (Bridge's ChatSFTPreprocessingConfig.loss_mode): 'assistant' trains every assistant turn
    (tool calls included, tool results never), 'last_turn' only the last assistant message, 'full' every token
    of the conversation. All three leave out Bridge's turn-start control tokens (<|im_start|>, ...)."""

    train_on_think: bool = True
    """Chat records: False keeps ``<think>...</think>`` spans of assistant turns in the input but out of the
    loss (the tags included)."""

    def __post_init__(self) -> None:  # also when built directly (the HF-dataset configs), not via dataset_kwargs
        _check_chat_loss_options(self)


def resolve_padding(opts: SFTFormatOptions, dataset_kwargs: Optional[dict[str, Any]], fixed_shapes: bool,
                    multiple: int) -> SFTFormatOptions:
    """``opts`` with what the user left unset decided for the layout: ``pad_to_max_length`` is ``fixed_shapes``
    (pipeline parallel) and ``pad_seq_length_to_mult`` becomes a multiple of ``multiple`` (what context / sequence
    parallel cut sequences into). Values set in ``dataset_kwargs`` are kept as given."""
    given = dict(dataset_kwargs or {})
    changes: dict[str, Any] = {}
    if opts.pad_to_max_length is None:
        changes["pad_to_max_length"] = fixed_shapes
    if "pad_seq_length_to_mult" not in given and opts.pad_seq_length_to_mult % multiple:
        changes["pad_seq_length_to_mult"] = math.lcm(opts.pad_seq_length_to_mult, multiple)
    return replace(opts, **changes) if changes else opts


def parse_format_options(dataset_kwargs: Optional[dict[str, Any]]) -> SFTFormatOptions:
    """``dataset.dataset_kwargs`` -> options; an unknown key or a bad value is a one-line ConfigError."""
    kwargs = dict(dataset_kwargs or {})
    known = {f.name: f for f in fields(SFTFormatOptions)}
    unknown = sorted(set(kwargs) - set(known))
    if unknown:
        raise NotSupportedError(
            f"dataset.dataset_kwargs has unsupported key(s) {unknown}; supported: {sorted(known)}"
        )
    opts = SFTFormatOptions(**kwargs)
    if opts.truncation_method not in ("left", "right"):
        raise ConfigError(
            f"dataset.dataset_kwargs.truncation_method={opts.truncation_method!r}: use 'left' or 'right'"
        )
    if not isinstance(opts.pad_seq_length_to_mult, int) or opts.pad_seq_length_to_mult < 1:
        raise ConfigError(
            f"dataset.dataset_kwargs.pad_seq_length_to_mult={opts.pad_seq_length_to_mult!r} must be an integer >= 1"
        )
    keys = template_keys(opts.prompt_template)
    if opts.label_key not in keys:
        raise ConfigError(
            f"dataset.dataset_kwargs.prompt_template={opts.prompt_template!r} has no '{{{opts.label_key}}}' "
            f"placeholder for label_key={opts.label_key!r}"
        )
    for name in _truncation_fields(opts):
        if name not in keys:
            raise ConfigError(
                f"dataset.dataset_kwargs.truncation_field={opts.truncation_field!r}: {name!r} is not a field of "
                f"prompt_template {opts.prompt_template!r}"
            )
    return opts


def _check_chat_loss_options(opts: SFTFormatOptions) -> None:
    if opts.loss_mode not in LOSS_MODES:
        raise ConfigError(f"dataset.dataset_kwargs.loss_mode={opts.loss_mode!r}: use one of {list(LOSS_MODES)}")
    if not isinstance(opts.train_on_think, bool):
        raise ConfigError(f"dataset.dataset_kwargs.train_on_think={opts.train_on_think!r}: use true or false")
    changed = [f"{name}={value!r}" for name, value, default in (
        ("loss_mode", opts.loss_mode, "assistant"), ("train_on_think", opts.train_on_think, True)) if value != default]
    if changed and not opts.answer_only_loss:
        raise ConfigError(f"dataset.dataset_kwargs: answer_only_loss=False trains on every token, so "
                          f"{', '.join(changed)} would have no effect; use loss_mode='full' instead")
    if changed and opts.chat is False:
        raise ConfigError(f"dataset.dataset_kwargs: {', '.join(changed)} applies to chat records, but chat=False")


def template_keys(template: str) -> list[str]:
    """The ``{key}`` placeholders of a prompt template, in order."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ConfigError(f"dataset.dataset_kwargs.prompt_template={template!r} is not valid: {exc}") from None
    return [name for _, name, _, _ in parsed if name is not None]


def _truncation_fields(opts: SFTFormatOptions) -> list[str]:
    return [f.strip() for f in str(opts.truncation_field).split(",") if f.strip()]


class PromptCompletionFormatter:
    """Prompt/completion records -> (ids, in_loss), Bridge's template semantics (see the module docstring)."""

    def __init__(self, tokenizer: Any, opts: SFTFormatOptions, max_ids: int) -> None:
        self.tokenizer = tokenizer
        self.opts = opts
        self.max_ids = max_ids
        self.pieces = [(literal, name) for literal, name, _, _ in string.Formatter().parse(opts.prompt_template)]
        self.keys = [name for _, name in self.pieces if name is not None]
        if opts.add_bos and getattr(tokenizer, "bos", None) is None:
            raise ConfigError("dataset.dataset_kwargs.add_bos=True, but the tokenizer has no BOS token")
        if opts.add_eos and getattr(tokenizer, "eos", None) is None and getattr(tokenizer, "eod", None) is None:
            raise ConfigError("dataset.dataset_kwargs.add_eos=True, but the tokenizer has no EOS token")

    def check_keys(self, keys: Any, where: Any) -> None:
        """A one-line DataError naming the first template field missing from ``keys``."""
        for key in self.keys:
            if key not in keys:
                raise DataError(f"{where}: the record has no {key!r} key (prompt_template {self.opts.prompt_template!r}; "
                                f"keys found: {sorted(keys)})")

    def __call__(self, record: dict[str, Any], where: str) -> tuple[np.ndarray, np.ndarray]:
        self.check_keys(record, where)
        tok = self.tokenizer.tokenize
        segments: list[tuple[Optional[str], list[int], bool]] = []  # (field name, ids, in completion)
        in_completion = False
        for literal, name in self.pieces:
            if literal:
                segments.append((None, tok(literal), in_completion))
            if name is not None:
                in_completion = in_completion or name == self.opts.label_key
                value = record[name]
                segments.append((name, tok(value if isinstance(value, str) else json.dumps(value)), in_completion))
        extra = int(self.opts.add_bos) + int(self.opts.add_eos)
        self._truncate(segments, extra)
        ids: list[int] = []
        flags: list[int] = []
        if self.opts.add_bos:
            ids.append(self.tokenizer.bos)
            flags.append(0)
        train_all = not self.opts.answer_only_loss
        for _, seg_ids, completion in segments:
            ids.extend(seg_ids)
            flags.extend([int(completion or train_all)] * len(seg_ids))
        if self.opts.add_eos:
            eos = self.tokenizer.eos if getattr(self.tokenizer, "eos", None) is not None else self.tokenizer.eod
            ids.append(eos)
            flags.append(1)
        ids, flags = ids[: self.max_ids], flags[: self.max_ids]
        return np.asarray(ids, dtype=np.int64), np.asarray(flags, dtype=np.int8)

    def _truncate(self, segments: list[tuple[Optional[str], list[int], bool]], extra: int) -> None:
        excess = sum(len(s[1]) for s in segments) + extra - self.max_ids
        for name in _truncation_fields(self.opts):
            for index, (seg_name, seg_ids, completion) in enumerate(segments):
                if excess <= 0:
                    return
                if seg_name != name:
                    continue
                cut = min(excess, len(seg_ids))
                kept = seg_ids[cut:] if self.opts.truncation_method == "left" else seg_ids[: len(seg_ids) - cut]
                segments[index] = (seg_name, kept, completion)
                excess -= cut


# ----------------------------------------------------------------------------------------------- chat

_GENERATION_TAG = re.compile(r"\{%-?\s*(end)?generation\s*-?%\}")


@lru_cache(maxsize=8)
def compile_chat_template(template: str) -> Callable[..., str]:
    """A render function for a Jinja chat template, in the environment transformers uses for
    ``apply_chat_template`` (sandboxed, trim_blocks/lstrip_blocks, loop controls, ``raise_exception``,
    ``tojson``, ``strftime_now``). ``{% generation %}`` markers are dropped: spans are found by rendering."""
    # jinja2 is not a declared dependency (torch brings it); only chat templates need it
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        compiled = env.from_string(_GENERATION_TAG.sub("", template))
    except jinja2.exceptions.TemplateError as exc:
        raise ConfigError(f"the chat template is not valid Jinja: {exc}") from None
    return compiled.render


def tokenizer_chat_template(tokenizer: Any) -> Optional[str]:
    """The chat template a tokenizer ships with (``chat_template`` attribute or method), or None."""
    value = getattr(tokenizer, "chat_template", None)
    if callable(value):
        value = value()
    return value if isinstance(value, str) and value else None


def _special_text(tokenizer: Any, token_id: Optional[int]) -> str:
    if token_id is None:
        return ""
    text = getattr(tokenizer, "token_text", None)
    return text(token_id) if callable(text) else tokenizer.detokenize([token_id])


class ChatFormatter:
    """Chat records -> (ids, in_loss) with the loss where ``loss_mode`` says (see the module docstring and
    ``chat_loss``)."""

    def __init__(self, tokenizer: Any, template: Optional[str], opts: SFTFormatOptions, max_ids: int) -> None:
        self.tokenizer = tokenizer
        self.template = template
        self.opts = opts
        self.max_ids = max_ids
        self._render: Optional[Callable[..., str]] = None
        self._specials: dict[str, str] = {}
        self._never_trained: frozenset[int] = frozenset()

    def __getstate__(self) -> dict[str, Any]:  # the compiled template is rebuilt (and cached) where it is used
        state = dict(self.__dict__)
        state["_render"] = None
        return state

    def _renderer(self, where: str) -> Callable[..., str]:
        if self._render is None:
            if self.template is None:
                raise DataError(
                    f"{where}: a chat record, but the tokenizer has no chat template: set tokenizer.chat_template"
                )
            self._render = compile_chat_template(self.template)
            t = self.tokenizer
            self._specials = {
                "bos_token": _special_text(t, getattr(t, "bos", None)),
                "eos_token": _special_text(t, getattr(t, "eos", None)),
                "pad_token": _special_text(t, getattr(t, "pad", None)),
            }
            self._never_trained = never_trained_ids(t)
        return self._render

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool, where: str,
               tools: Optional[list[Any]] = None) -> str:
        """The template applied to ``messages`` (the text ``apply_chat_template(tokenize=False)`` gives)."""
        import jinja2  # not a declared dependency (torch brings it); only chat templates need it

        render = self._renderer(where)
        try:
            return render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                          **self._specials)
        except jinja2.exceptions.TemplateError as exc:
            raise DataError(f"{where}: the chat template failed on this record: {exc}") from None

    def __call__(self, record: dict[str, Any], where: str) -> tuple[np.ndarray, np.ndarray]:
        messages = normalize_messages(record.get(self.opts.messages_key), self.opts.messages_key, where)
        if any(isinstance(m["content"], list) and any(isinstance(p, dict) and p.get("type") == "image"
                                                      for p in m["content"]) for m in messages):
            raise DataError(f"{where}: the conversation has images, but no image processor formats the data (a "
                            "text-only model; a vision-language model's directory gives one as tokenizer or "
                            "dataset.hf_processor_path)")
        tools = record.get("tools")  # tool schemas for the template, as transformers' apply_chat_template(tools=)
        mode = self.opts.loss_mode
        assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if not assistant and (mode != "full" or not self.opts.answer_only_loss):
            raise DataError(f"{where}: the conversation has no assistant turn, so nothing would be trained on")
        full_text = self.render(messages, False, where, tools)
        with_offsets = getattr(self.tokenizer, "tokenize_with_offsets", None)
        if callable(with_offsets):
            ids, offsets = with_offsets(full_text)
            ids = list(ids)
        else:
            ids, offsets = list(self.tokenizer.tokenize(full_text)), None
        if not self.opts.answer_only_loss:
            flags = np.ones(len(ids), dtype=np.int8)
        else:
            located = assistant[-1:] if mode == "last_turn" else assistant
            if mode == "full" and self.opts.train_on_think:
                located = []  # every token is trained: no turn needs finding
            spans = [self._turn_chars(messages, k, full_text, where, tools) for k in located]
            trained = [] if mode == "full" else [
                self._token_bounds(ids, offsets, full_text, span, k, where) for k, span in zip(located, spans)]
            thinking = [] if self.opts.train_on_think else [
                self._overlapping_tokens(ids, offsets, full_text, think)
                for span in spans for think in think_spans(full_text, *span)]
            flags = loss_flags(len(ids), mode, trained, thinking, ids, self._never_trained)
        return np.asarray(ids[: self.max_ids], dtype=np.int64), np.asarray(flags[: self.max_ids], dtype=np.int8)

    def _turn_chars(self, messages: list[dict[str, Any]], k: int, full_text: str, where: str,
                    tools: Optional[list[Any]]) -> tuple[int, int]:
        """Characters [start, end) of assistant turn ``k`` in the full render: what the template adds for it
        after the generation prompt."""
        before = self.render(messages[:k], True, where, tools)
        upto = self.render(messages[: k + 1], False, where, tools)
        if not (full_text.startswith(upto) and upto.startswith(before)):
            raise DataError(
                f"{where}: cannot find assistant turn {k} in the chat template's output (rendering the "
                f"conversation up to it is not a prefix of the full render; the template rewrites earlier turns)"
            )
        return len(before), len(upto)

    def _token_bounds(self, ids: list[int], offsets: Optional[list[tuple[int, int]]], full_text: str,
                      span: tuple[int, int], turn: int, where: Any) -> tuple[int, int]:
        """Token indices [start, end) of the characters ``span`` of the full render (on token boundaries)."""
        bounds = []
        for cut in span:
            index, straddles = self._token_index(ids, offsets, full_text, cut)
            if straddles:
                raise DataError(
                    f"{where}: assistant turn {turn} does not start or end on a token boundary of the full render "
                    f"(a token spans the turn boundary); cannot mask the prompt"
                )
            bounds.append(index)
        return bounds[0], bounds[1]

    def _overlapping_tokens(self, ids: list[int], offsets: Optional[list[tuple[int, int]]], full_text: str,
                            span: tuple[int, int]) -> tuple[int, int]:
        """Token indices [start, end) of every token touching the characters ``span`` (a token that straddles
        an edge is included)."""
        if offsets is not None:
            return tokens_overlapping(offsets, *span)
        start, _ = self._token_index(ids, None, full_text, span[0])
        end, straddles = self._token_index(ids, None, full_text, span[1])
        return start, end + int(straddles)

    def _token_index(self, ids: list[int], offsets: Optional[list[tuple[int, int]]], full_text: str,
                     cut: int) -> tuple[int, bool]:
        """(number of tokens starting before character ``cut``, whether the last of them runs past it); without
        offsets, the tokens of ``full_text[:cut]`` must be a prefix of ``ids``, else the first differing token
        is taken to straddle the cut."""
        if offsets is not None:
            index = sum(1 for s, _ in offsets if s < cut)
            return index, index > 0 and offsets[index - 1][1] > cut
        prefix = list(self.tokenizer.tokenize(full_text[:cut]))
        if ids[: len(prefix)] == prefix:
            return len(prefix), False
        common = next((i for i, (a, b) in enumerate(zip(ids, prefix)) if a != b), min(len(ids), len(prefix)))
        return common, True


class RecordFormatter:
    """Picks the chat or the prompt/completion formatter per record (or as ``dataset_kwargs.chat`` says)."""

    def __init__(self, tokenizer: Any, opts: SFTFormatOptions, max_ids: int, chat_template: Optional[str]) -> None:
        self.opts = opts
        self.prompt = PromptCompletionFormatter(tokenizer, opts, max_ids)
        self.chat = ChatFormatter(tokenizer, chat_template or tokenizer_chat_template(tokenizer), opts, max_ids)

    def check_keys(self, keys: list[str], where: Any) -> None:
        """A one-line DataError when records with these keys cannot be formatted (checked once per key set,
        when the file is indexed, so a bad record stops the run before its first step)."""
        is_chat = self.opts.chat if self.opts.chat is not None else self.opts.messages_key in keys
        if is_chat and self.opts.messages_key not in keys:
            raise DataError(f"{where}: dataset_kwargs.chat=True, but the record has no {self.opts.messages_key!r} key")
        if is_chat and self.chat.template is None:
            raise DataError(f"{where}: a chat record, but the tokenizer has no chat template: set tokenizer.chat_template")
        if not is_chat:
            self.prompt.check_keys(keys, where)

    def __call__(self, record: dict[str, Any], where: str) -> tuple[np.ndarray, np.ndarray]:
        is_chat = self.opts.chat if self.opts.chat is not None else self.opts.messages_key in record
        if is_chat and self.opts.messages_key not in record:
            raise DataError(f"{where}: dataset_kwargs.chat=True, but the record has no {self.opts.messages_key!r} key")
        return self.chat(record, where) if is_chat else self.prompt(record, where)
