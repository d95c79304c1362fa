"""The T5 span-corruption dataset, sample for sample against megatron-core's T5MaskedWordPieceDataset (oracle)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from megatron.core.datasets.indexed_dataset import IndexedDataset as McoreIndexedDataset
from megatron.core.datasets.t5_dataset import T5MaskedWordPieceDataset as McoreT5Dataset
from megatron.core.datasets.t5_dataset import T5MaskedWordPieceDatasetConfig as McoreT5Config
from megatron.core.datasets.utils import Split as McoreSplit

from longspan.core.errors import ConfigError
from longspan.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from longspan.data.t5_dataset import MT19937_64, PERMUTATION_STREAM, T5MaskedWordPieceDataset, build_sample_mapping
from longspan.data.utils import Split

VOCAB = 120
CLS, SEP, MASK, PAD, BOS, EOS = 1, 2, 3, 4, 5, 6
SENTINELS = list(range(100, 120))


class WordPieceTokenizer:
    """Ids 10..99; every third id is a '##' continuation piece (whole-word masking groups it with its word)."""

    cls, sep, mask, pad, bos, eos = CLS, SEP, MASK, PAD, BOS, EOS
    eod = EOS
    additional_special_tokens_ids = SENTINELS
    vocab_size = VOCAB
    unique_identifiers = {"class": "WordPieceTokenizer"}

    def __init__(self) -> None:
        self.inv_vocab = {i: (f"##p{i}" if i >= 10 and i % 3 == 0 else f"w{i}") for i in range(VOCAB)}

    def token_text(self, token_id: int) -> str:
        return self.inv_vocab[token_id]

    @property
    def special_tokens_dict(self):
        return {"cls_token": CLS, "sep_token": SEP, "mask_token": MASK, "pad_token": PAD, "bos_token": BOS,
                "eos_token": EOS}


def _write_corpus(prefix: str, seed: int = 0) -> None:
    """Documents of 1-6 'sentences' of uneven lengths (one with a sentence over 512 tokens: skipped)."""
    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for doc in range(40):
        for _ in range(int(rng.integers(1, 7))):
            length = int(rng.integers(3, 40))
            sentence = rng.integers(10, 100, length).tolist() + [SEP]
            builder.add_item(torch.tensor(sentence))
        if doc == 7:
            builder.add_item(torch.tensor(rng.integers(10, 100, 600).tolist()))
        builder.end_document()
    builder.finalize(prefix + ".idx")


def _settings(**kw):
    base = dict(random_seed=1234, sequence_length=96, sequence_length_decoder=48, masking_probability=0.15,
                short_sequence_probability=0.1, masking_max_ngram=10, masking_do_full_word=True,
                masking_do_permutation=False, masking_use_longer_ngrams=False, masking_use_geometric_distribution=True)
    base.update(kw)
    return base


def _mcore_dataset(prefix, tokenizer, indices, num_samples, tmp_path, monkeypatch, **settings):
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a, **k: 0)  # its index builder asks for rank 0
    config = McoreT5Config(tokenizer=tokenizer, blend=([prefix], None), split="1,0,0", path_to_cache=str(tmp_path / "mc"),
                           **settings)
    return McoreT5Dataset(McoreIndexedDataset(prefix), prefix, indices, num_samples, McoreSplit.train, config)


@pytest.mark.parametrize(
    "settings",
    [
        _settings(),
        _settings(masking_use_geometric_distribution=False, masking_use_longer_ngrams=True, masking_max_ngram=3,
                  short_sequence_probability=0.3, masking_do_full_word=False, random_seed=7),
        _settings(masking_use_geometric_distribution=False, short_sequence_probability=0.0, masking_probability=0.3,
                  sequence_length=64, sequence_length_decoder=64),
        _settings(masking_use_geometric_distribution=False, masking_do_permutation=True, masking_max_ngram=3,
                  masking_do_full_word=False, random_seed=11),
    ],
    ids=["t5-defaults", "1-over-n-longer-ngrams", "no-short-sequences", "permuted-ngrams"],
)
def test_samples_equal_megatron_core(tmp_path, monkeypatch, settings):
    prefix = str(tmp_path / "corpus")
    _write_corpus(prefix)
    tokenizer = WordPieceTokenizer()
    indices = np.arange(3, 37, dtype=np.int32)  # a split in the middle of the corpus
    num_samples = 150  # more than one epoch of documents: repeats them, as megatron-core does
    oracle = _mcore_dataset(prefix, tokenizer, indices, num_samples, tmp_path, monkeypatch, **settings)
    config = SimpleNamespace(tokenizer=tokenizer, **settings)
    ours = T5MaskedWordPieceDataset(IndexedDataset(prefix), prefix, indices, num_samples, Split.train, config)
    np.testing.assert_array_equal(ours.sample_index, np.asarray(oracle.sample_index))
    assert len(ours) == len(oracle) >= num_samples
    truncated = permuted = 0
    for idx in range(len(ours)):
        # megatron-core draws the permutation's n-gram sizes from numpy's global generator; longspan from a
        # per-sample generator with this seed
        np.random.seed([(settings["random_seed"] + idx) % 2**32, PERMUTATION_STREAM])
        want, got = oracle[idx], ours[idx]
        assert set(got) == set(want)
        for key in want:
            assert np.array_equal(got[key].numpy(), np.asarray(want[key])), (idx, key)
        truncated += int(got["truncated"])
        if settings["masking_do_permutation"]:
            unpermuted = T5MaskedWordPieceDataset.__new__(T5MaskedWordPieceDataset)
            unpermuted.__dict__.update(ours.__dict__, config=SimpleNamespace(**{**vars(config),
                                                                                "masking_do_permutation": False}))
            same_spans = torch.equal(unpermuted[idx]["labels"], got["labels"])
            permuted += int(same_spans and not torch.equal(unpermuted[idx]["text_enc"], got["text_enc"]))
    assert 0 < truncated < len(ours)
    if settings["masking_do_permutation"]:  # it reorders encoder tokens (in most samples), never the masked spans
        assert permuted > len(ours) * 0.9


def test_sample_layout_sentinels_and_masks(tmp_path):
    prefix = str(tmp_path / "corpus")
    _write_corpus(prefix)
    tokenizer = WordPieceTokenizer()
    config = SimpleNamespace(tokenizer=tokenizer, **_settings())
    ds = T5MaskedWordPieceDataset(IndexedDataset(prefix), prefix, np.arange(40, dtype=np.int32), 30, Split.train, config)
    s = ds[0]
    n_dec = int(s["loss_mask"].sum())
    dec, labels, enc = s["text_dec"], s["labels"], s["text_enc"]
    assert dec[0] == BOS and labels[n_dec - 1] == EOS
    assert torch.equal(dec[1:n_dec], labels[: n_dec - 1])  # teacher forcing: labels are the inputs shifted by one
    used = [t for t in enc.tolist() if t in SENTINELS]
    assert used == SENTINELS[: len(used)] and len(used) > 0  # sentinels in order, one per span
    assert [t for t in labels[:n_dec].tolist() if t in SENTINELS] == used
    assert (labels[n_dec:] == -1).all() and (s["dec_mask"][:n_dec] == 1).all() and (s["dec_mask"][n_dec:] == 0).all()
    assert int(s["enc_mask"].sum()) == int((enc != 0).sum())


def test_mt19937_64_matches_the_cpp_standard():
    # The C++ standard requires the 10000th output of a default-constructed std::mt19937_64 (seed 5489).
    gen = MT19937_64(5489)
    for _ in range(9999):
        gen()
    assert gen() == 9981545732273789042


def test_mapping_skips_documents_with_a_long_sentence():
    bounds = np.array([0, 2, 3])
    lengths = np.array([10, 600, 700])
    mapping = build_sample_mapping(bounds, lengths, 1, 10, 50, 0.0, 1, 1)
    assert mapping.tolist() == [[2, 3, 50]]  # doc 0 (two sequences, one long) skipped; doc 1 (one sequence) kept


def test_config_errors_are_one_line(tmp_path):
    prefix = str(tmp_path / "corpus")
    _write_corpus(prefix)
    low = IndexedDataset(prefix)
    idx = np.arange(10, dtype=np.int32)
    tok = WordPieceTokenizer()
    with pytest.raises(ConfigError, match="^dataset.masking_do_permutation=True with dataset.masking_use_geometric"):
        T5MaskedWordPieceDataset(low, prefix, idx, 5, Split.train,
                                 SimpleNamespace(tokenizer=tok, **_settings(masking_do_permutation=True,
                                                                            masking_use_geometric_distribution=True)))
    no_sentinels = WordPieceTokenizer()
    no_sentinels.additional_special_tokens_ids = []
    with pytest.raises(ConfigError, match="vocab_extra_ids"):
        T5MaskedWordPieceDataset(low, prefix, idx, 5, Split.train, SimpleNamespace(tokenizer=no_sentinels, **_settings()))
    with pytest.raises(ConfigError, match="masking_probability=1.5"):
        T5MaskedWordPieceDataset(low, prefix, idx, 5, Split.train,
                                 SimpleNamespace(tokenizer=tok, **_settings(masking_probability=1.5)))


def test_vocab_extra_ids_append_sentinels_after_the_vocabulary():
    import pickle

    from longspan.config.schema.data import TokenizerConfig
    from longspan.data.tokenizers import ExtraIdsTokenizer, build_tokenizer

    tok = build_tokenizer(TokenizerConfig(tokenizer_type="ByteLevelTokenizer", vocab_size=512, vocab_extra_ids=3))
    assert isinstance(tok, ExtraIdsTokenizer)
    assert (tok.eos, tok.pad, tok.bos) == (0, 1, 512)  # the base keeps eos/pad; bos is added (it had none)
    assert tok.additional_special_tokens_ids == [513, 514, 515] and tok.vocab_size == 516
    ids = tok.tokenize("ab") + [514] + tok.tokenize("c")
    assert tok.detokenize(ids) == "ab<extra_id_1>c" and tok.token_text(513) == "<extra_id_0>"
    assert pickle.loads(pickle.dumps(tok)).additional_special_tokens_ids == [513, 514, 515]  # DataLoader workers
    plain = build_tokenizer(TokenizerConfig(tokenizer_type="ByteLevelTokenizer", vocab_size=512, vocab_extra_ids=0))
    assert not isinstance(plain, ExtraIdsTokenizer)
    with pytest.raises(ConfigError, match="vocab_extra_ids=-1"):
        build_tokenizer(TokenizerConfig(tokenizer_type="ByteLevelTokenizer", vocab_size=512, vocab_extra_ids=-1))
