"""Tokenizers selected by ``TokenizerConfig.tokenizer_type`` (Megatron Bridge's names).

Every tokenizer exposes ``vocab_size``, ``eod`` (end of document), ``eos``, ``bos`` and ``pad`` (None when it
has none), ``tokenize(text) -> list[int]`` (no special tokens added), ``detokenize(ids) -> str`` and
``save_files(directory)``, which writes what is needed to rebuild it (so tokenizers travel with checkpoints;
``build_tokenizer`` of the saved directory with the same ``tokenizer_type`` gives the same tokenizer).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence

from tokenizers import AddedToken, Tokenizer as FastTokenizer, decoders, models, pre_tokenizers

from longspan.core.errors import ConfigError, DataError
from longspan.core.logging import get_logger
from longspan.data.tiktoken_tokenizer import TikTokenizer
from longspan.data.tokenizer_base import Tokenizer

if TYPE_CHECKING:
    # for type checkers only: the config package loads torch, which building a tokenizer does not need
    from longspan.config.schema.data import TokenizerConfig

logger = get_logger(__name__)


def _token_text(value: Any) -> Optional[str]:
    """A special token in tokenizer_config.json is a string or {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class HuggingFaceTokenizer(Tokenizer):
    """A Hugging Face tokenizer from a local directory or a ``tokenizer.json`` file.

    ``tokenizer.json`` is read with the ``tokenizers`` library (special tokens from the
    ``tokenizer_config.json`` beside it); a directory without one goes through ``transformers.AutoTokenizer``.
    EOD is the end-of-sequence token, else ``<|endoftext|>``.
    """

    _EOS_GUESSES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")
    _BOS_GUESSES = ("<s>", "<bos>", "<|begin_of_text|>", "[CLS]")
    _PAD_GUESSES = ("<pad>", "[PAD]", "<|pad|>")

    def __init__(self, path: str, **hf_kwargs: Any) -> None:
        self.path = path
        json_file = path if os.path.isfile(path) else os.path.join(path, "tokenizer.json")
        self._hf = None
        self._fast = None
        if os.path.isfile(json_file):
            try:
                self._fast = FastTokenizer.from_file(json_file)
            except Exception as exc:  # the tokenizers library raises its own exception type
                raise DataError(f"cannot read tokenizer file {json_file}: {exc}") from None
            self._json_file = json_file
            self._config_file = os.path.join(os.path.dirname(json_file), "tokenizer_config.json")
            conf = {}
            if os.path.isfile(self._config_file):
                with open(self._config_file) as f:
                    conf = json.load(f)
            self.vocab_size = self._fast.get_vocab_size(with_added_tokens=True)
            self.eos = self._special(_token_text(conf.get("eos_token")), self._EOS_GUESSES)
            self.bos = self._special(_token_text(conf.get("bos_token")), self._BOS_GUESSES)
            self.pad = self._special(_token_text(conf.get("pad_token")), self._PAD_GUESSES)
            eot = self._fast.token_to_id("<|endoftext|>")
        elif os.path.isdir(path):
            try:
                from transformers import AutoTokenizer  # optional dependency: the hf extra
            except ImportError:
                raise ConfigError(
                    f"tokenizer.tokenizer_model={path!r} has no tokenizer.json; reading it needs the transformers "
                    f"package (pip install transformers)"
                ) from None
            try:
                self._hf = AutoTokenizer.from_pretrained(path, local_files_only=True, **hf_kwargs)
            except Exception as exc:
                raise DataError(f"cannot load a Hugging Face tokenizer from {path}: {exc}") from None
            self.vocab_size = len(self._hf)
            self.eos, self.bos, self.pad = self._hf.eos_token_id, self._hf.bos_token_id, self._hf.pad_token_id
            eot = self._hf.convert_tokens_to_ids("<|endoftext|>")
            eot = None if eot == self._hf.unk_token_id else eot
        else:
            raise ConfigError(
                f"tokenizer.tokenizer_model={path!r} does not exist: give a local directory with tokenizer.json "
                f"(or tokenizer files for transformers), a tokenizer.json file, or builtin:stdlib"
            )
        self.eod = self.eos if self.eos is not None else eot

    def _special(self, text: Optional[str], guesses: Sequence[str]) -> Optional[int]:
        for candidate in ([text] if text else []) + ([] if text else list(guesses)):
            tid = self._fast.token_to_id(candidate)
            if tid is not None:
                return tid
        return None

    def tokenize(self, text: str) -> List[int]:
        if self._fast is not None:
            return self._fast.encode(text, add_special_tokens=False).ids
        return self._hf.encode(text, add_special_tokens=False)

    def tokenize_with_offsets(self, text: str) -> tuple[List[int], List[tuple[int, int]]]:
        """Token ids and each token's (start, end) character span in ``text``."""
        if self._fast is not None:
            enc = self._fast.encode(text, add_special_tokens=False)
            return enc.ids, [tuple(o) for o in enc.offsets]
        enc = self._hf(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]

    def token_text(self, token_id: int) -> str:
        """The text of one token (special tokens included), as chat templates see ``bos_token`` etc."""
        if self._fast is not None:
            return self._fast.id_to_token(token_id)
        return self._hf.convert_ids_to_tokens(token_id)

    def chat_template(self) -> Optional[str]:
        """The chat template the tokenizer ships with (tokenizer_config.json's ``chat_template``), or None."""
        if self._hf is not None:
            template = getattr(self._hf, "chat_template", None)
        else:
            conf = {}
            if os.path.isfile(self._config_file):
                with open(self._config_file) as f:
                    conf = json.load(f)
            template = conf.get("chat_template")
            if template is None and os.path.isfile(os.path.join(os.path.dirname(self._json_file), "chat_template.jinja")):
                with open(os.path.join(os.path.dirname(self._json_file), "chat_template.jinja")) as f:
                    template = f.read()
        if isinstance(template, list):  # named templates: the default one
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        return template if isinstance(template, str) else None

    def tokenize_batch(self, texts: List[str]) -> List[List[int]]:
        """Token ids of several texts (parallel inside the tokenizers library when it can)."""
        if self._fast is not None:
            return [e.ids for e in self._fast.encode_batch(texts, add_special_tokens=False)]
        return [self.tokenize(t) for t in texts]

    def detokenize(self, ids: Sequence[int]) -> str:
        if self._fast is not None:
            return self._fast.decode(list(ids), skip_special_tokens=False)
        return self._hf.decode(list(ids))

    def save_with_special_tokens(self, directory: str, tokens: List[str]) -> None:
        """Rewrite the saved files in ``directory`` with ``tokens`` added as additional special tokens (new ones
        get the next ids in order, as ``SpecialTokensTokenizer`` gives them)."""
        if self._fast is None:
            self._hf.add_special_tokens({"additional_special_tokens": tokens})
            self._hf.save_pretrained(directory)
            return
        fast = FastTokenizer.from_file(os.path.join(directory, "tokenizer.json"))
        fast.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in tokens])
        fast.save(os.path.join(directory, "tokenizer.json"))
        config_path = os.path.join(directory, "tokenizer_config.json")
        conf = {}
        if os.path.isfile(config_path):
            with open(config_path) as f:
                conf = json.load(f)
        conf["additional_special_tokens"] = tokens
        with open(config_path, "w") as f:
            json.dump(conf, f)

    def save_files(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        if self._fast is not None:
            shutil.copyfile(self._json_file, os.path.join(directory, "tokenizer.json"))
            if os.path.isfile(self._config_file):
                shutil.copyfile(self._config_file, os.path.join(directory, "tokenizer_config.json"))
        else:
            self._hf.save_pretrained(directory)


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece ``.model`` file; EOD is its EOS piece."""

    def __init__(self, model_file: str) -> None:
        if not model_file or not os.path.isfile(model_file):
            raise ConfigError(f"tokenizer.tokenizer_model={model_file!r} is not a SentencePiece .model file")
        try:
            import sentencepiece  # optional dependency: the sentencepiece extra
        except ImportError:
            raise ConfigError("SentencePieceTokenizer needs the sentencepiece package (pip install sentencepiece)") from None
        self.model_file = model_file
        self._sp = sentencepiece.SentencePieceProcessor(model_file=model_file)
        self.vocab_size = int(self._sp.get_piece_size())
        as_id = lambda i: None if i < 0 else int(i)  # noqa: E731 - sentencepiece uses -1 for "none"
        self.bos, self.eos, self.pad = as_id(self._sp.bos_id()), as_id(self._sp.eos_id()), as_id(self._sp.pad_id())
        self.eod = self.eos

    def tokenize(self, text: str) -> List[int]:
        return list(self._sp.encode(text))

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def save_files(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        shutil.copyfile(self.model_file, os.path.join(directory, "tokenizer.model"))


class GPT2BPETokenizer(Tokenizer):
    """GPT-2's byte-level BPE from ``vocab.json`` + ``merges.txt``; EOD is ``<|endoftext|>``."""

    def __init__(self, vocab_file: str, merge_file: str) -> None:
        for name, value in (("vocab_file", vocab_file), ("merge_file", merge_file)):
            if not value or not os.path.isfile(value):
                raise ConfigError(f"tokenizer.{name}={value!r} does not exist (GPT2BPETokenizer needs vocab.json and merges.txt)")
        self.vocab_file, self.merge_file = vocab_file, merge_file
        self._tok = FastTokenizer(models.BPE.from_file(vocab_file, merge_file))
        self._tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self._tok.decoder = decoders.ByteLevel()
        self.vocab_size = self._tok.get_vocab_size()
        self.eod = self._tok.token_to_id("<|endoftext|>")
        self.eos = self.eod

    def tokenize(self, text: str) -> List[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def save_files(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        shutil.copyfile(self.vocab_file, os.path.join(directory, "vocab.json"))
        shutil.copyfile(self.merge_file, os.path.join(directory, "merges.txt"))


def _is_int(word: str) -> bool:
    try:
        int(word)
    except ValueError:
        return False
    return True


class NullTokenizer(Tokenizer):
    """Ids written as space-separated integers (for mock data): vocab_size ids plus EOD = vocab_size."""

    def __init__(self, vocab_size: int) -> None:
        if vocab_size is None or int(vocab_size) <= 0:
            raise ConfigError(f"tokenizer.vocab_size={vocab_size!r}: NullTokenizer needs a positive vocab_size")
        self._vocab_without_eod = int(vocab_size)
        self.vocab_size = self._vocab_without_eod + 1
        self.eod = self._vocab_without_eod
        self.eos = None

    def tokenize(self, text: str) -> List[int]:
        try:
            return [int(x) for x in text.split()]
        except ValueError:
            word = next(w for w in text.split() if not _is_int(w))
            raise DataError(
                f"NullTokenizer expects space-separated integer token ids, got {word[:40]!r}"
            ) from None

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)

    def save_files(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "null_tokenizer.json"), "w") as f:
            json.dump({"vocab_size": self._vocab_without_eod}, f)


class ByteLevelTokenizer(Tokenizer):
    """UTF-8 bytes as ids, needing no files (megatron-core's ByteLevelTokenizer: vocab 512, EOS 0, PAD 1)."""

    def __init__(self, vocab_size: int = 512, eos_id: int = 0, pad_id: int = 1) -> None:
        self.vocab_size = int(vocab_size) if vocab_size else 512
        if self.vocab_size < 256:
            raise ConfigError(f"tokenizer.vocab_size={vocab_size}: a byte-level tokenizer needs at least 256")
        self.eos = self.eod = eos_id
        self.pad = pad_id

    def tokenize(self, text: str) -> List[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def save_files(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "byte_level_tokenizer.json"), "w") as f:
            json.dump({"vocab_size": self.vocab_size}, f)


class _AddedTokensText:
    """Text of a wrapper's ids: its added tokens (``self.added_tokens``, id -> text) by itself, the rest by
    ``self.base``."""

    added_tokens: Dict[int, str]
    base: Any

    def token_text(self, token_id: int) -> str:
        """The text of one token (added tokens included)."""
        if int(token_id) in self.added_tokens:
            return self.added_tokens[int(token_id)]
        text = getattr(self.base, "token_text", None)
        return text(int(token_id)) if text is not None else self.base.detokenize([int(token_id)])

    def detokenize(self, ids: Sequence[int]) -> str:
        out, run = [], []
        for token_id in ids:
            if int(token_id) in self.added_tokens:
                out += [self.base.detokenize(run)] if run else []
                out.append(self.added_tokens[int(token_id)])
                run = []
            else:
                run.append(int(token_id))
        return "".join(out + ([self.base.detokenize(run)] if run else []))


class ExtraIdsTokenizer(_AddedTokensText, Tokenizer):
    """A tokenizer with ``vocab_extra_ids`` sentinel tokens ``<extra_id_0>``, ``<extra_id_1>``, ... appended after
    its vocabulary (T5 span corruption; ``additional_special_tokens_ids`` lists them in order), and ``<bos>`` /
    ``<eos>`` appended first when the base tokenizer has none (as Megatron's T5 WordPiece tokenizer adds them).
    Text is tokenized by the base tokenizer; everything else it offers is reached through this one."""

    def __init__(self, base: Tokenizer, vocab_extra_ids: int) -> None:
        self.base = base
        self.eos, self.bos, self.pad, self.eod = base.eos, base.bos, base.pad, base.eod
        next_id = int(base.vocab_size)
        self.added_tokens: Dict[int, str] = {}
        if self.bos is None:
            self.bos, self.added_tokens[next_id], next_id = next_id, "<bos>", next_id + 1
        if self.eos is None:
            self.eos, self.added_tokens[next_id], next_id = next_id, "<eos>", next_id + 1
            self.eod = self.eod if self.eod is not None else self.eos
        self.additional_special_tokens_ids = list(range(next_id, next_id + int(vocab_extra_ids)))
        for i, token_id in enumerate(self.additional_special_tokens_ids):
            self.added_tokens[token_id] = f"<extra_id_{i}>"
        self.vocab_size = next_id + int(vocab_extra_ids)

    def __getattr__(self, name: str) -> Any:
        if name == "base":  # not set yet (unpickling)
            raise AttributeError(name)
        return getattr(self.base, name)

    def tokenize(self, text: str) -> List[int]:
        return self.base.tokenize(text)

    def save_files(self, directory: str) -> None:
        self.base.save_files(directory)  # the extra ids come back from tokenizer.vocab_extra_ids

    @property
    def special_tokens_dict(self) -> Dict[str, int]:
        return {**super().special_tokens_dict, **{t: i for i, t in self.added_tokens.items()}}


def _existing_token_id(tokenizer: Tokenizer, token: str) -> Optional[int]:
    """The id ``token`` already has in ``tokenizer`` as one token, or None."""
    fast, hf = getattr(tokenizer, "_fast", None), getattr(tokenizer, "_hf", None)
    if fast is not None:
        return fast.token_to_id(token)
    if hf is not None:
        tid = hf.convert_tokens_to_ids(token)
        return None if tid is None or tid == hf.unk_token_id else int(tid)
    specials = getattr(tokenizer, "special_tokens", None)
    if isinstance(specials, list) and token in specials:
        return specials.index(token)
    return None


class SpecialTokensTokenizer(_AddedTokensText, Tokenizer):
    """A tokenizer with ``tokenizer.special_tokens`` added as Hugging Face adds additional special tokens: one
    already in the vocabulary keeps its id, the others get new ids after it in order; text is split at every
    special token's string so each becomes its one id, and the pieces between are tokenized by the base."""

    def __init__(self, base: Tokenizer, special_tokens: Sequence[str]) -> None:
        if not all(isinstance(t, str) and t for t in special_tokens) or len(set(special_tokens)) != len(special_tokens):
            raise ConfigError(f"tokenizer.special_tokens={list(special_tokens)!r} must be distinct non-empty strings")
        self.base = base
        self.eos, self.bos, self.pad, self.eod = base.eos, base.bos, base.pad, base.eod
        self.token_ids: Dict[str, int] = {}
        next_id = int(base.vocab_size)
        for token in special_tokens:
            existing = _existing_token_id(base, token)
            self.token_ids[token], next_id = (existing, next_id) if existing is not None else (next_id, next_id + 1)
        self.added_tokens = {i: t for t, i in self.token_ids.items()}
        self.additional_special_tokens_ids = list(self.token_ids.values())
        self.vocab_size = next_id
        self._by_length = sorted(self.token_ids, key=len, reverse=True)

    def __getattr__(self, name: str) -> Any:
        if name == "base":  # not set yet (unpickling)
            raise AttributeError(name)
        return getattr(self.base, name)

    def _split(self, text: str) -> List[tuple[str, Optional[int]]]:
        pieces: List[tuple[str, Optional[int]]] = []
        start = pos = 0
        while pos < len(text):
            token = next((t for t in self._by_length if text.startswith(t, pos)), None)
            if token is None:
                pos += 1
                continue
            pieces += [(text[start:pos], None)] if pos > start else []
            pieces.append((token, self.token_ids[token]))
            pos = start = pos + len(token)
        return pieces + ([(text[start:], None)] if start < len(text) else [])

    def tokenize(self, text: str) -> List[int]:
        ids: List[int] = []
        for piece, special_id in self._split(text):
            ids += [special_id] if special_id is not None else self.base.tokenize(piece)
        return ids

    def tokenize_with_offsets(self, text: str) -> tuple[List[int], List[tuple[int, int]]]:
        """Token ids and each token's (start, end) character span in ``text`` (needs the base's offsets)."""
        ids: List[int] = []
        spans: List[tuple[int, int]] = []
        start = 0
        for piece, special_id in self._split(text):
            if special_id is not None:
                ids.append(special_id)
                spans.append((start, start + len(piece)))
            else:
                piece_ids, piece_spans = self.base.tokenize_with_offsets(piece)
                ids += piece_ids
                spans += [(a + start, b + start) for a, b in piece_spans]
            start += len(piece)
        return ids, spans

    def save_files(self, directory: str) -> None:
        """The base's files; a Hugging Face tokenizer's also hold the added tokens, so the directory works as an
        HF tokenizer by itself (rebuilding with tokenizer.special_tokens finds them there: the same ids)."""
        self.base.save_files(directory)
        if isinstance(self.base, HuggingFaceTokenizer):
            self.base.save_with_special_tokens(directory, list(self.token_ids))

    @property
    def special_tokens_dict(self) -> Dict[str, int]:
        return {**self.base.special_tokens_dict, **self.token_ids}


TOKENIZER_TYPES = ("HuggingFaceTokenizer", "SentencePieceTokenizer", "GPT2BPETokenizer", "NullTokenizer", "ByteLevelTokenizer",
                   "TikTokenizer")


def model_vocab_size(tokenizer: Tokenizer, tokenizer_config: TokenizerConfig) -> int:
    """The vocabulary size a model takes from ``tokenizer`` when model.vocab_size is null: the tokenizer's,
    rounded up to a multiple of ``tokenizer.make_vocab_size_divisible_by`` (Megatron's padded vocabulary)."""
    multiple = int(tokenizer_config.make_vocab_size_divisible_by or 1)
    return -(-int(tokenizer.vocab_size) // multiple) * multiple


# megatron-core's tokenizer metadata ``library`` -> tokenizer_type
METADATA_LIBRARIES = {"huggingface": "HuggingFaceTokenizer", "sentencepiece": "SentencePieceTokenizer",
                      "tiktoken": "TikTokenizer", "null": "NullTokenizer", "byte-level": "ByteLevelTokenizer"}


def _read_metadata(metadata_path: Any) -> Dict[str, Any]:
    if isinstance(metadata_path, dict):
        return metadata_path
    try:
        with open(str(metadata_path), encoding="utf-8") as f:
            metadata = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"tokenizer.metadata_path={metadata_path!r} cannot be read as JSON: {exc}") from None
    if not isinstance(metadata, dict):
        raise ConfigError(f"tokenizer.metadata_path={metadata_path!r} must hold a JSON object")
    return metadata


def apply_tokenizer_metadata(tokenizer_config: TokenizerConfig) -> None:
    """Fill ``tokenizer_type`` and ``chat_template`` where they are None from ``tokenizer.metadata_path``
    (megatron-core's tokenizer metadata: a JSON file or a mapping with ``library``, ``chat_template``,
    ``model_type``); a library that contradicts tokenizer_type, or a custom tokenizer class, is one line."""
    metadata_path = tokenizer_config.metadata_path
    if metadata_path is None:
        return
    metadata = _read_metadata(metadata_path)
    if metadata.get("class_name") or metadata.get("class_path") or metadata.get("tokenizer_class"):
        raise ConfigError(f"tokenizer.metadata_path names a custom tokenizer class "
                          f"({metadata.get('class_path')}.{metadata.get('class_name')}): longspan builds its own "
                          f"tokenizers only; remove class_name/class_path")
    library = metadata.get("library")
    if library not in METADATA_LIBRARIES:
        raise ConfigError(f"tokenizer.metadata_path library={library!r} is not valid: use one of "
                          f"{', '.join(METADATA_LIBRARIES)}")
    ttype = tokenizer_config.tokenizer_type
    if ttype is None:
        tokenizer_config.tokenizer_type = METADATA_LIBRARIES[library]
    elif ttype != METADATA_LIBRARIES[library] and not (library == "byte-level" and ttype == "ByteTokenizer"):
        raise ConfigError(f"tokenizer.tokenizer_type={ttype!r} contradicts tokenizer.metadata_path's library "
                          f"{library!r} ({METADATA_LIBRARIES[library]}): set one of them")
    if tokenizer_config.chat_template is None and metadata.get("chat_template"):
        tokenizer_config.chat_template = metadata["chat_template"]


def build_tokenizer(tokenizer_config: TokenizerConfig) -> Tokenizer:
    """The tokenizer a ``TokenizerConfig`` names, with ``special_tokens`` added
    (``SpecialTokensTokenizer``) and ``vocab_extra_ids`` sentinel tokens appended (``ExtraIdsTokenizer``) when set;
    ``metadata_path`` fills tokenizer_type and chat_template first (``apply_tokenizer_metadata``)."""
    apply_tokenizer_metadata(tokenizer_config)
    tokenizer = _build_base_tokenizer(tokenizer_config)
    special = tokenizer_config.special_tokens
    if special:
        tokenizer = SpecialTokensTokenizer(tokenizer, list(special))
    extra = tokenizer_config.vocab_extra_ids or 0
    if not isinstance(extra, int) or extra < 0:
        raise ConfigError(f"tokenizer.vocab_extra_ids={extra!r} must be a non-negative integer")
    return ExtraIdsTokenizer(tokenizer, extra) if extra else tokenizer


def _build_base_tokenizer(tokenizer_config: TokenizerConfig) -> Tokenizer:
    """The tokenizer a ``TokenizerConfig`` names, without extra ids.

    ``tokenizer_model='builtin:stdlib'`` with HuggingFaceTokenizer is the BPE tokenizer (vocab 4096) trained
    on the corpus that ships with longspan, prepared and cached on first use.
    """
    ttype = tokenizer_config.tokenizer_type
    model = tokenizer_config.tokenizer_model
    if ttype == "HuggingFaceTokenizer":
        if model is None:
            raise ConfigError("tokenizer.tokenizer_model is required for HuggingFaceTokenizer (a directory, tokenizer.json, or builtin:stdlib)")
        model = str(model)
        if model.startswith("builtin:"):
            # data.builtin loads torch (through indexed_dataset); only builtin: tokenizers pay for it
            from longspan.data.builtin import builtin_tokenizer_dir

            model = builtin_tokenizer_dir(model)
        return HuggingFaceTokenizer(model, **(tokenizer_config.hf_tokenizer_kwargs or {}))
    if ttype == "SentencePieceTokenizer":
        return SentencePieceTokenizer(model)
    if ttype == "GPT2BPETokenizer":
        return GPT2BPETokenizer(tokenizer_config.vocab_file, tokenizer_config.merge_file)
    if ttype == "NullTokenizer":
        return NullTokenizer(tokenizer_config.vocab_size)
    if ttype == "TikTokenizer":
        return TikTokenizer(model, tokenizer_config.tiktoken_pattern, tokenizer_config.vocab_size,
                            tokenizer_config.tiktoken_num_special_tokens, tokenizer_config.tiktoken_special_tokens)
    if ttype in ("ByteLevelTokenizer", "ByteTokenizer"):
        return ByteLevelTokenizer(tokenizer_config.vocab_size or 512)
    if ttype is None:
        raise ConfigError(
            f"tokenizer.tokenizer_type is not set: set it ({', '.join(TOKENIZER_TYPES)}) or give "
            f"checkpoint.pretrained_checkpoint=DIR (an HF model directory or a longspan checkpoint) to take it from"
        )
    raise ConfigError(f"tokenizer.tokenizer_type={ttype!r} is not supported; valid: {', '.join(TOKENIZER_TYPES)}")
