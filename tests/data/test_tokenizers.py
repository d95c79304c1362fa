"""Tokenizers: ids equal the reference libraries', special ids, and save_files round trips."""

from __future__ import annotations

import json

import pytest

from longspan.config.schema.data import TokenizerConfig
from longspan.core.errors import ConfigError
from longspan.data.tokenizers import build_tokenizer

TEXTS = ["def f(x):\n    return x + 1\n", "Hello world, the quick brown fox.", "naïve café ünïcode ✓"]
CORPUS = [f"line {i}: the quick brown fox jumps over the lazy dog; def f{i}(x): return x * {i}\n" for i in range(300)]


def _train_bpe(directory, eos=True):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<pad>"] if eos else ["<pad>"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer=trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    if eos:
        (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "pad_token": "<pad>"}))
    return tok


def test_huggingface_tokenizer_matches_transformers(tmp_path):
    from transformers import PreTrainedTokenizerFast

    _train_bpe(tmp_path / "hf")
    tok = build_tokenizer(TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "hf")))
    ref = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "hf" / "tokenizer.json"))
    for text in TEXTS:
        assert tok.tokenize(text) == ref.encode(text, add_special_tokens=False)
        assert tok.detokenize(tok.tokenize(text)) == text
    assert tok.vocab_size == len(ref)
    assert tok.eod == tok.eos == ref.convert_tokens_to_ids("<|endoftext|>")
    assert tok.pad == ref.convert_tokens_to_ids("<pad>") and tok.bos is None
    # save_files -> a tokenizer with the same behaviour
    tok.save_files(str(tmp_path / "saved"))
    again = build_tokenizer(TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "saved")))
    assert [again.tokenize(t) for t in TEXTS] == [tok.tokenize(t) for t in TEXTS]
    assert (again.eod, again.pad, again.vocab_size) == (tok.eod, tok.pad, tok.vocab_size)


def test_gpt2_bpe_matches_transformers(tmp_path):
    from transformers import GPT2Tokenizer

    trained = _train_bpe(tmp_path / "hf")
    trained.model.save(str(tmp_path))  # vocab.json + merges.txt
    cfg = TokenizerConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=str(tmp_path / "vocab.json"), merge_file=str(tmp_path / "merges.txt"))
    tok = build_tokenizer(cfg)
    ref = GPT2Tokenizer(str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"))
    for text in TEXTS:
        assert tok.tokenize(text) == ref.encode(text)
    assert tok.eod == ref.convert_tokens_to_ids("<|endoftext|>") and tok.pad is None
    tok.save_files(str(tmp_path / "saved"))
    again = build_tokenizer(TokenizerConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=str(tmp_path / "saved" / "vocab.json"),
                               merge_file=str(tmp_path / "saved" / "merges.txt")))
    assert again.tokenize(TEXTS[0]) == tok.tokenize(TEXTS[0])


def test_sentencepiece(tmp_path):
    spm = pytest.importorskip("sentencepiece")
    corpus = tmp_path / "c.txt"
    corpus.write_text("".join(CORPUS))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "sp"), vocab_size=120,
                                   minloglevel=2, pad_id=3)
    ref = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    tok = build_tokenizer(TokenizerConfig(tokenizer_type="SentencePieceTokenizer", tokenizer_model=str(tmp_path / "sp.model")))
    assert tok.tokenize(TEXTS[1]) == ref.encode(TEXTS[1])
    assert (tok.vocab_size, tok.bos, tok.eos, tok.eod, tok.pad) == (120, ref.bos_id(), ref.eos_id(), ref.eos_id(), 3)
    tok.save_files(str(tmp_path / "saved"))
    again = build_tokenizer(TokenizerConfig(tokenizer_type="SentencePieceTokenizer", tokenizer_model=str(tmp_path / "saved" / "tokenizer.model")))
    assert again.tokenize(TEXTS[1]) == tok.tokenize(TEXTS[1])


def test_null_tokenizer():
    tok = build_tokenizer(TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=100))
    # Megatron's NullTokenizer: ids as text, EOD appended after the vocabulary.
    assert tok.tokenize("5 7 99") == [5, 7, 99] and tok.detokenize([5, 7]) == "5 7"
    assert (tok.vocab_size, tok.eod, tok.pad) == (101, 100, None)


def test_byte_level_tokenizer(tmp_path):
    tok = build_tokenizer(TokenizerConfig(tokenizer_type="ByteLevelTokenizer", vocab_size=None))
    text = TEXTS[2]
    assert tok.tokenize(text) == list(text.encode("utf-8"))
    assert tok.detokenize(tok.tokenize(text)) == text
    assert (tok.vocab_size, tok.eod, tok.pad) == (512, 0, 1)
    tok.save_files(str(tmp_path / "b"))
    assert (tmp_path / "b").is_dir() and any((tmp_path / "b").iterdir())


@pytest.mark.parametrize("cfg", [
    TokenizerConfig(tokenizer_type="NoSuchTokenizer", tokenizer_model=None),
    TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model="/nonexistent/tok"),
    TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=None),
])
def test_bad_tokenizer_configs(cfg):
    with pytest.raises(ConfigError) as e:
        build_tokenizer(cfg)
    assert "tokenizer." in str(e.value) and "\n" not in str(e.value)
