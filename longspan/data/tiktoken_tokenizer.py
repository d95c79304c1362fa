"""Megatron's TikTokenizer: a tiktoken BPE whose vocabulary is a local JSON file, with special tokens first.

The vocabulary file is a JSON list of ``{"rank": i, "token_bytes": base64, "token_str": str}`` (entry i has
rank i; the first 256 are the single bytes). Ids 0..num_special_tokens-1 are the special tokens (the given
list, then ``<SPECIAL_i>`` fillers); the BPE vocabulary follows, shifted by num_special_tokens and cut so the
whole vocabulary has ``vocab_size`` ids, as megatron-core's TikTokenTokenizer lays it out.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
from typing import Dict, List, Optional, Sequence

from longspan.core.errors import ConfigError, DataError
from longspan.data.tokenizer_base import Tokenizer

PATTERNS = {
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
}
DEFAULT_VOCAB_SIZE = 2**17
REQUIRED_SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>"]


def _load_ranks(path: str, inner_vocab: int, shift: int) -> Dict[bytes, int]:
    try:
        with open(path, encoding="utf-8") as f:
            vocab = json.load(f)
    except (OSError, ValueError) as exc:
        raise DataError(f"cannot read the TikToken vocabulary {path}: {exc}") from None
    if not isinstance(vocab, list) or len(vocab) < inner_vocab:
        size = len(vocab) if isinstance(vocab, list) else "not a list"
        raise DataError(f"TikToken vocabulary {path} has {size} entries; tokenizer.vocab_size minus "
                        f"tokenizer.tiktoken_num_special_tokens needs {inner_vocab}")
    ranks: Dict[bytes, int] = {}
    for i, entry in enumerate(vocab[:inner_vocab]):
        if not isinstance(entry, dict) or entry.get("rank") != i or "token_bytes" not in entry:
            raise DataError(f"TikToken vocabulary {path}: entry {i} is not {{'rank': {i}, 'token_bytes': ...}}")
        piece = base64.b64decode(entry["token_bytes"])
        if i < 256 and piece != bytes([i]):
            raise DataError(f"TikToken vocabulary {path}: entry {i} must be the single byte {i}")
        ranks[piece] = i + shift
    return ranks


class TikTokenizer(Tokenizer):
    """tiktoken BPE from Megatron's JSON vocabulary; EOD and EOS are ``</s>``, BOS ``<s>``, PAD ``<pad>``."""

    def __init__(self, path: str, pattern: Optional[str], vocab_size: Optional[int] = None,
                 num_special_tokens: int = 1000, special_tokens: Optional[List[str]] = None) -> None:
        try:
            import tiktoken  # optional dependency: the tiktoken extra
        except ImportError:
            raise ConfigError("tokenizer.tokenizer_type='TikTokenizer' needs the tiktoken package "
                              "(pip install 'longspan[tiktoken]')") from None
        if not path or not os.path.isfile(path):
            raise ConfigError(f"tokenizer.tokenizer_model={path!r} is not a TikToken vocabulary file (.json)")
        if pattern not in PATTERNS:
            raise ConfigError(f"tokenizer.tiktoken_pattern={pattern!r} is not valid: use 'v1' or 'v2'")
        special = list(special_tokens) if special_tokens else list(REQUIRED_SPECIAL_TOKENS)
        missing = [t for t in REQUIRED_SPECIAL_TOKENS if t not in special]
        if missing or len(set(special)) != len(special):
            raise ConfigError(f"tokenizer.tiktoken_special_tokens={special_tokens!r} must be unique and include "
                              f"{REQUIRED_SPECIAL_TOKENS}")
        self.vocab_size = int(vocab_size or DEFAULT_VOCAB_SIZE)
        if not len(special) <= num_special_tokens < self.vocab_size:
            raise ConfigError(f"tokenizer.tiktoken_num_special_tokens={num_special_tokens} must be at least the "
                              f"{len(special)} special tokens and below tokenizer.vocab_size={self.vocab_size}")
        self.path, self.pattern, self.num_special_tokens = path, pattern, int(num_special_tokens)
        self.special_tokens = special + [f"<SPECIAL_{i}>" for i in range(len(special), num_special_tokens)]
        ranks = _load_ranks(path, self.vocab_size - num_special_tokens, num_special_tokens)
        self._encoding = tiktoken.Encoding(
            name=os.path.basename(os.path.dirname(os.path.abspath(path))) or "tiktoken", pat_str=PATTERNS[pattern],
            mergeable_ranks=ranks, special_tokens={t: i for i, t in enumerate(self.special_tokens)})
        self.bos, self.eos, self.pad = (self.special_tokens.index(t) for t in ("<s>", "</s>", "<pad>"))
        self.eod = self.eos

    def tokenize(self, text: str) -> List[int]:
        """Ids of ``text``; special-token strings in it become their ids (as megatron-core encodes)."""
        return self._encoding.encode(text, allowed_special="all")

    def token_text(self, token_id: int) -> str:
        """The text of one token (special tokens included)."""
        if int(token_id) < self.num_special_tokens:
            return self.special_tokens[int(token_id)]
        return self._encoding.decode_single_token_bytes(int(token_id)).decode("utf-8", errors="replace")

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._encoding.decode([int(i) for i in ids], errors="replace")

    def save_files(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        shutil.copyfile(self.path, os.path.join(directory, "tiktoken_vocab.json"))
