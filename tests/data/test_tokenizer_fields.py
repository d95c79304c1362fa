"""tokenizer.special_tokens, the TikTokenizer and tokenizer.make_vocab_size_divisible_by against their references."""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path

import pytest

from longspan.config.schema.data import TokenizerConfig
from longspan.core.errors import ConfigError, DataError
from longspan.data.tokenizers import build_tokenizer, model_vocab_size
from tests.data.test_tokenizers import _train_bpe

SPECIALS = ["<|im_start|>", "<|im_end|>", "<pad>"]  # <pad> is already in the trained vocabulary
CHAT = "<|im_start|>user\nthe quick fox<|im_end|>\n<|im_start|>assistant\ndef f(x): return x<|im_end|><pad>"


def test_special_tokens_match_transformers_additional_special_tokens(tmp_path: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    _train_bpe(tmp_path / "hf")
    tok = build_tokenizer(TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "hf"),
                             special_tokens=SPECIALS))
    ref = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "hf" / "tokenizer.json"))
    ref.add_special_tokens({"additional_special_tokens": SPECIALS})
    assert tok.tokenize(CHAT) == ref.encode(CHAT, add_special_tokens=False)
    assert tok.vocab_size == len(ref)
    assert tok.additional_special_tokens_ids == ref.convert_tokens_to_ids(SPECIALS)
    assert tok.detokenize(tok.tokenize(CHAT)) == CHAT
    ids, spans = tok.tokenize_with_offsets(CHAT)
    assert ids == tok.tokenize(CHAT) and CHAT[spans[0][0]:spans[0][1]] == "<|im_start|>"
    assert "".join(CHAT[a:b] for a, b in spans) == CHAT
    # saved files hold the added tokens: as an HF tokenizer by themselves, and rebuilt with special_tokens again
    tok.save_files(str(tmp_path / "saved"))
    saved = PreTrainedTokenizerFast.from_pretrained(str(tmp_path / "saved"))
    assert saved.encode(CHAT, add_special_tokens=False) == tok.tokenize(CHAT) and len(saved) == tok.vocab_size
    again = build_tokenizer(TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "saved"),
                               special_tokens=SPECIALS))
    assert again.tokenize(CHAT) == tok.tokenize(CHAT) and again.vocab_size == tok.vocab_size
    plain = build_tokenizer(TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "hf")))
    assert plain.tokenize(CHAT) != tok.tokenize(CHAT)
    with pytest.raises(ConfigError, match=r"tokenizer.special_tokens=\['a', 'a'\] must be distinct"):
        build_tokenizer(TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=10, special_tokens=["a", "a"]))


def _tiktoken_vocab(path: Path, merges: list[bytes]) -> Path:
    pieces = [bytes([i]) for i in range(256)] + merges
    path.write_text(json.dumps([{"rank": i, "token_bytes": base64.b64encode(p).decode(), "token_str": p.decode("latin-1")}
                                for i, p in enumerate(pieces)]))
    return path


MERGES = [b"th", b"the", b" t", b" th", b" the", b"qu", b"ick", b"fo", b"ox", b"aB"]
TEXT = "the quick fox <s>then</s> ünï"
# megatron-core 0.16.1's TikTokenTokenizer(vocab, num_special_tokens=10, pattern="v2", vocab_size=276)
# .text_to_ids(TEXT), recorded (importing megatron-core costs seconds per test run)
MEGATRON_CORE_IDS = [267, 42, 271, 115, 109, 117, 42, 273, 130, 42, 1, 267, 120, 2, 42, 205, 198, 120, 205, 185]


def _tiktoken_cfg(path: Path, **kw) -> TokenizerConfig:
    base = dict(tokenizer_type="TikTokenizer", tokenizer_model=str(path), tiktoken_pattern="v2",
                vocab_size=256 + len(MERGES) + 10, tiktoken_num_special_tokens=10, tiktoken_special_tokens=None)
    return TokenizerConfig(**{**base, **kw})


def test_tiktokenizer_lays_out_ids_as_megatron_core(tmp_path: Path) -> None:
    vocab = _tiktoken_vocab(tmp_path / "vocab.json", MERGES)
    tok = build_tokenizer(_tiktoken_cfg(vocab))
    ids = tok.tokenize(TEXT)
    assert ids[0] == 10 + 256 + MERGES.index(b"the")  # merged pieces, shifted past the 10 special ids
    assert 1 in ids and 2 in ids  # "<s>" and "</s>" in the text are their special ids
    assert (tok.bos, tok.eos, tok.eod, tok.pad, tok.vocab_size) == (1, 2, 2, 4, 276)
    assert tok.detokenize(ids) == TEXT and tok.token_text(9) == "<SPECIAL_9>"
    assert ids == MEGATRON_CORE_IDS
    # v2 splits camel case before the merges, v1 does not; the files travel with checkpoints
    assert build_tokenizer(_tiktoken_cfg(vocab, tiktoken_pattern="v1")).tokenize("aB") == [10 + 256 + 9]
    assert tok.tokenize("aB") == [10 + ord("a"), 10 + ord("B")]
    from longspan.training.checkpointing.load import use_saved_tokenizer

    tok.save_files(str(tmp_path / "saved"))
    cfg = _tiktoken_cfg(vocab)
    use_saved_tokenizer(cfg, tmp_path / "saved")
    assert build_tokenizer(cfg).tokenize(TEXT) == ids


def test_tiktokenizer_special_tokens_and_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    vocab = _tiktoken_vocab(tmp_path / "vocab.json", MERGES)
    mine = ["<|user|>", "<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>"]
    tok = build_tokenizer(_tiktoken_cfg(vocab, tiktoken_special_tokens=mine))
    assert tok.tokenize("<|user|>the") == [0, 10 + 256 + 1] and (tok.bos, tok.eos) == (2, 3)
    with pytest.raises(ConfigError, match="tiktoken_special_tokens=.*must be unique and include"):
        build_tokenizer(_tiktoken_cfg(vocab, tiktoken_special_tokens=["<s>"]))
    with pytest.raises(ConfigError, match="tiktoken_pattern=None is not valid: use 'v1' or 'v2'"):
        build_tokenizer(_tiktoken_cfg(vocab, tiktoken_pattern=None))
    with pytest.raises(DataError, match="has 266 entries; .* needs 990"):
        build_tokenizer(_tiktoken_cfg(vocab, vocab_size=1000))
    monkeypatch.setitem(sys.modules, "tiktoken", None)
    with pytest.raises(ConfigError, match=r"needs the tiktoken package \(pip install 'longspan\[tiktoken\]'\)"):
        build_tokenizer(_tiktoken_cfg(vocab))


def test_tokenizer_vocab_padding_sets_the_model_vocabulary() -> None:
    tok = build_tokenizer(TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=100))
    assert model_vocab_size(tok, TokenizerConfig(make_vocab_size_divisible_by=1)) == 101
    assert model_vocab_size(tok, TokenizerConfig(make_vocab_size_divisible_by=64)) == 128


def test_metadata_fills_the_type_and_chat_template(tmp_path: Path) -> None:
    _train_bpe(tmp_path / "hf")
    meta = tmp_path / "hf" / "tokenizer_metadata.json"
    meta.write_text(json.dumps({"library": "huggingface", "model_type": "gpt", "chat_template": "{{ messages }}"}))
    cfg = TokenizerConfig(tokenizer_type=None, tokenizer_model=str(tmp_path / "hf"), metadata_path=str(meta), chat_template=None)
    tok = build_tokenizer(cfg)
    assert (cfg.tokenizer_type, cfg.chat_template) == ("HuggingFaceTokenizer", "{{ messages }}")
    assert tok.tokenize("the fox") == build_tokenizer(TokenizerConfig(tokenizer_type="HuggingFaceTokenizer",
                                                          tokenizer_model=str(tmp_path / "hf"))).tokenize("the fox")
    null = TokenizerConfig(tokenizer_type=None, vocab_size=10, metadata_path={"library": "null"}, chat_template="kept")
    assert build_tokenizer(null).vocab_size == 11 and null.chat_template == "kept"
    for metadata, fragment in (({"library": "null"}, "contradicts tokenizer.metadata_path's library 'null'"),
                               ({"library": "hf"}, "library='hf' is not valid"),
                               ({"library": "null", "class_name": "Mine"}, "names a custom tokenizer class"),
                               (str(tmp_path / "missing.json"), "cannot be read as JSON")):
        with pytest.raises(ConfigError, match=fragment):
            build_tokenizer(TokenizerConfig(tokenizer_type="ByteLevelTokenizer", metadata_path=metadata))
