"""The interface every longspan tokenizer exposes (longspan.data.tokenizers builds them)."""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence


class Tokenizer:
    """Common interface of longspan's tokenizers."""

    vocab_size: int
    eod: Optional[int] = None
    eos: Optional[int] = None
    bos: Optional[int] = None
    pad: Optional[int] = None

    def tokenize(self, text: str) -> List[int]:
        """Token ids of ``text`` without added special tokens."""
        raise NotImplementedError

    def detokenize(self, ids: Sequence[int]) -> str:
        """Text of token ids."""
        raise NotImplementedError

    def save_files(self, directory: str) -> None:
        """Write the files this tokenizer is built from into ``directory``."""
        raise NotImplementedError

    @property
    def special_tokens_dict(self) -> Dict[str, int]:
        """Special token ids by role (used to detect a pad id that collides with another special token)."""
        roles = {"eos_token": self.eos, "bos_token": self.bos, "pad_token": self.pad}
        return {k: v for k, v in roles.items() if v is not None}
