"""T5 span corruption on Megatron ``.bin``/``.idx`` data, with megatron-core's ``T5MaskedWordPieceDataset``
sample semantics (the same samples for the same data, seed and settings).

A sample is built from whole sequences ("sentences") of one document, up to a target length of
``sequence_length - 2`` (sometimes shorter: ``short_sequence_probability``), as megatron-core's
``build_mapping`` picks them. Spans of tokens are then masked (n-grams of whole words; lengths from a geometric
distribution, SpanBERT-style, or a 1/n distribution); each masked span becomes one sentinel token
(``tokenizer.additional_special_tokens_ids``, the ``vocab_extra_ids`` of the tokenizer config) in the encoder
input, and the decoder predicts ``sentinel, span tokens`` for each span, then ``eos``. With
``masking_do_permutation`` (1/n n-gram sizes only), further n-grams outside the masked spans, up to the same
token budget, have their tokens shuffled among themselves in the encoder input (megatron-core's BERT-style
permutation)::

    tokens          a b c d e f g h
    encoder input   a <X0> d e <X1> h                         (+ padding to sequence_length)
    decoder input   bos <X0> b c <X1> f g                     (+ padding to sequence_length_decoder)
    labels              <X0> b c <X1> f g eos                 (-1 after, loss_mask 1 on the real tokens)

Random numbers: the sample index uses C++'s ``std::mt19937`` / ``std::mt19937_64`` streams exactly as
megatron-core's helper does; each sample draws from ``numpy.random.RandomState(random_seed + idx)``, and the
sizes of the n-grams to permute from a second per-sample generator (``permutation_size_rng``; megatron-core uses
numpy's global generator there).
"""

from __future__ import annotations

from collections import deque
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from longspan.config.rules.data import check_masking_choices
from longspan.config.schema.data import T5MaskedWordPieceDatasetConfig
from longspan.core.errors import ConfigError, DataError
from longspan.data.indexed_dataset import IndexedDataset
from longspan.data.utils import Split

# Seeds the second per-sample generator, which draws the sizes of the n-grams to permute.
PERMUTATION_STREAM = 1
LONG_SENTENCE_LEN = 512  # megatron-core: documents with a sequence longer than this (and > 1 sequence) are skipped
T5_SAMPLE_KEYS = ("text_enc", "text_dec", "labels", "loss_mask", "enc_mask", "dec_mask")


# ------------------------------------------------------------------------------------------ random streams


def _mt19937_stream(seed: int):
    """Raw 32-bit outputs of ``std::mt19937(seed)`` (numpy's legacy seeding is the same init_genrand)."""
    bit_generator = np.random.RandomState(seed)._bit_generator
    while True:
        for value in bit_generator.random_raw(1024):
            yield int(value)


class MT19937_64:
    """C++'s ``std::mt19937_64`` (the 64-bit Mersenne Twister with its standard seeding)."""

    _N, _M = 312, 156
    _MASK = (1 << 64) - 1

    def __init__(self, seed: int) -> None:
        state = [int(seed) & self._MASK]
        for i in range(1, self._N):
            prev = state[-1]
            state.append((6364136223846793005 * (prev ^ (prev >> 62)) + i) & self._MASK)
        self.state, self.index = state, self._N

    def _twist(self) -> None:
        mt, n, m = self.state, self._N, self._M
        for i in range(n):
            x = (mt[i] & 0xFFFFFFFF80000000) | (mt[(i + 1) % n] & 0x7FFFFFFF)
            xa = (x >> 1) ^ (0xB5026F5AA96619E9 if x & 1 else 0)
            mt[i] = mt[(i + m) % n] ^ xa
        self.index = 0

    def __call__(self) -> int:
        if self.index >= self._N:
            self._twist()
        y = self.state[self.index]
        self.index += 1
        y ^= (y >> 29) & 0x5555555555555555
        y ^= (y << 17) & 0x71D67FFFEDA60000
        y ^= (y << 37) & 0xFFF7EEE000000000
        y ^= y >> 43
        return y & self._MASK


# ------------------------------------------------------------------------------------------ sample index


def build_sample_mapping(
    document_bounds: np.ndarray,
    sequence_lengths: np.ndarray,
    num_epochs: int,
    max_num_samples: int,
    max_seq_length: int,
    short_seq_prob: float,
    seed: int,
    min_num_sent: int,
) -> np.ndarray:
    """``[num_samples, 3]`` rows (first sequence, end sequence, target length), shuffled: megatron-core's
    ``helpers.build_mapping`` for masked-LM datasets.

    ``document_bounds`` holds the first sequence index of each document and, last, the end of the final one.
    Epochs repeat the documents until ``max_num_samples`` is reached at an epoch boundary.
    """
    if seed <= 0:
        raise ConfigError(f"dataset.random_seed={seed}: the T5 sample mapping needs a positive seed")
    short_ratio = int(round(1.0 / short_seq_prob)) if short_seq_prob > 0 else 0
    rand32 = _mt19937_stream(seed)

    def target_length() -> int:
        if short_ratio == 0:
            return max_seq_length
        r = next(rand32)
        return 2 + r % (max_seq_length - 1) if r % short_ratio == 0 else max_seq_length

    rows: List[Tuple[int, int, int]] = []
    for _ in range(num_epochs):
        if len(rows) >= max_num_samples:
            break
        for doc in range(len(document_bounds) - 1):
            first, last = int(document_bounds[doc]), int(document_bounds[doc + 1])
            remaining = last - first
            has_long = remaining > 1 and bool((sequence_lengths[first:last] > LONG_SENTENCE_LEN).any())
            if remaining < min_num_sent or has_long:
                continue
            start, seq_len, num_sent = first, 0, 0
            target = target_length()
            for sent in range(first, last):
                seq_len += int(sequence_lengths[sent])
                num_sent += 1
                remaining -= 1
                if (seq_len >= target and remaining > 1 and num_sent >= min_num_sent) or remaining == 0:
                    rows.append((start, sent + 1, target))
                    start, seq_len, num_sent = sent + 1, 0, 0
                    target = target_length()
        if num_epochs > 1 and not rows:
            raise DataError("the T5 dataset split has no document that yields a sample")
    mapping = np.array(rows, dtype=np.int64).reshape(-1, 3)
    rand64 = MT19937_64(seed + 1)
    for i in range(len(mapping) - 1, 0, -1):  # Fisher-Yates, as the C++ helper
        j = rand64() % (i + 1)
        mapping[[i, j]] = mapping[[j, i]]
    return mapping


# ------------------------------------------------------------------------------------------ span masking


def _ngram_candidates(tokens: Sequence[int], tokenizer: Any, full_word: bool) -> List[List[int]]:
    """Positions grouped into maskable words (a WordPiece ``##`` piece joins the word before it)."""
    cls, sep = getattr(tokenizer, "cls", None), getattr(tokenizer, "sep", None)
    candidates: List[List[int]] = []
    for i, token in enumerate(tokens):
        if token == cls or token == sep:
            continue
        if _is_continuation(tokenizer, token) and full_word and candidates:
            candidates[-1].append(i)
        else:
            candidates.append([i])
    return candidates


def _is_continuation(tokenizer: Any, token: int) -> bool:
    text = getattr(tokenizer, "token_text", None)
    return bool(text is not None and text(int(token)).startswith("##"))


def _fit_ngram(options: List[List[List[int]]], n: int, budget: float) -> Optional[List[int]]:
    """The positions of the longest n-gram of at most ``n`` words from ``options`` (``options[k - 1]`` holds
    k words, fewer at the end) whose token count fits ``budget``; None when even one word does not fit."""
    while True:
        positions = sum(options[n - 1], [])
        n -= 1
        if budget >= len(positions):
            return positions
        if n == 0:
            return None


def _ngram_size_distribution(config: T5MaskedWordPieceDatasetConfig) -> Tuple[np.ndarray, np.ndarray]:
    """The n-gram sizes 1..max_ngram and their 1/n probabilities (reversed to favour long n-grams)."""
    sizes = np.arange(config.masking_max_ngram, dtype=np.int64) + 1
    probs = 1.0 / sizes
    probs = probs / probs.sum(keepdims=True)
    return sizes, (probs[::-1] if config.masking_use_longer_ngrams else probs)


def mask_spans(tokens: List[int], target_length: int, rng: np.random.RandomState,
               config: T5MaskedWordPieceDatasetConfig, tokenizer: Any,
               permutation_size_rng: Optional[np.random.RandomState] = None
               ) -> Tuple[List[int], List[Tuple[List[int], List[int]]]]:
    """The sample's tokens (n-grams permuted when ``masking_do_permutation``) and its masked spans
    ``[(positions, original tokens)]`` in position order: megatron-core's choice, draw for draw.

    ``permutation_size_rng`` draws the sizes of the n-grams to permute (megatron-core draws them from numpy's
    global generator); the permutation itself is drawn from ``rng``, after the masking."""
    candidates = _ngram_candidates(tokens, tokenizer, bool(config.masking_do_full_word))
    n_maskings = min(config.masking_probability * target_length,
                     max(1, int(round(len(tokens) * config.masking_probability))))
    ngram_sizes, probs = _ngram_size_distribution(config)
    # For each start word, the n-grams of 1..max_ngram words starting there.
    ngrams = [[candidates[i: i + n] for n in ngram_sizes] for i in range(len(candidates))]
    rng.shuffle(ngrams)
    masked: set = set()
    spans: List[Tuple[List[int], List[int]]] = []
    for options in ngrams:
        if len(masked) >= n_maskings:
            break
        if not options:
            continue
        if config.masking_use_geometric_distribution:
            n = min(rng.geometric(0.2), config.masking_max_ngram)
        else:
            p = probs[: len(options)] / probs[: len(options)].sum(keepdims=True)
            n = rng.choice(ngram_sizes[: len(options)], p=p)
        positions = _fit_ngram(options, n, n_maskings - len(masked))
        if positions is None or any(p in masked for p in positions):
            continue
        masked.update(positions)
        spans.append((positions, [tokens[p] for p in positions]))
    rng.shuffle(ngrams)  # drawn with or without permutation: the permutation walks this second order
    if config.masking_do_permutation:
        size_rng = permutation_size_rng if permutation_size_rng is not None else np.random
        tokens = _permute_ngrams(tokens, ngrams, masked, n_maskings, probs, rng, size_rng)
    return tokens, sorted(spans, key=lambda span: span[0][0])


def _permute_ngrams(tokens: List[int], ngrams: List[List[List[List[int]]]], masked: set, budget: float,
                    probs: np.ndarray, rng: np.random.RandomState, size_rng: np.random.RandomState) -> List[int]:
    """Pick unmasked n-grams (1/n sizes, up to ``budget`` tokens in all) in the order of ``ngrams`` and
    shuffle the tokens at the picked positions among themselves (BERT-style permutation)."""
    ngram_sizes = np.arange(len(probs), dtype=np.int64) + 1
    picked: set = set()
    for options in ngrams:
        if len(picked) >= budget:
            break
        if not options:
            continue
        p = probs[: len(options)] / probs[: len(options)].sum(keepdims=True)
        n = size_rng.choice(ngram_sizes[: len(options)], p=p)
        positions = _fit_ngram(options, n, budget - len(picked))
        if positions is None or any(p in masked or p in picked for p in positions):
            continue
        picked.update(positions)
    targets = sorted(picked)
    sources = list(targets)
    rng.shuffle(sources)
    permuted = list(tokens)
    for target, source in zip(targets, sources):
        permuted[target] = tokens[source]
    return permuted


def permutation_size_rng(random_seed: int, idx: int) -> np.random.RandomState:
    """The generator of sample ``idx``'s permutation n-gram sizes: seeded by ``[(random_seed + idx) % 2**32,
    PERMUTATION_STREAM]``. megatron-core draws these from numpy's global generator instead, so its samples depend
    on the order they are read in (and on DataLoader workers); seeding numpy's global generator with the same
    seed right before megatron-core's ``__getitem__(idx)`` gives the same sample."""
    return np.random.RandomState(seed=[(random_seed + idx) % 2**32, PERMUTATION_STREAM])


# ------------------------------------------------------------------------------------------ dataset


class T5MaskedWordPieceDataset(torch.utils.data.Dataset):
    """T5 span-corruption samples from a split of an ``IndexedDataset`` (megatron-core's constructor).

    Each sample is a dict of int64 tensors: ``text_enc`` [sequence_length], ``text_dec`` / ``labels`` /
    ``loss_mask`` / ``dec_mask`` [sequence_length_decoder], ``enc_mask`` [sequence_length] (1 = real token),
    and ``truncated`` (whether the sequences were cut to the target length). Padding ids become 0 in the
    inputs and labels are -1 after the target (megatron-core's values; the loss mask excludes them).
    """

    def __init__(self, indexed_dataset: Any, dataset_path: Optional[str], indexed_indices: np.ndarray,
                 num_samples: Optional[int], index_split: Split, config: T5MaskedWordPieceDatasetConfig) -> None:
        self.dataset = indexed_dataset
        self.dataset_path = dataset_path
        self.indices = indexed_indices
        self.num_samples = num_samples
        self.index_split = index_split
        self.config = config
        tokenizer = config.tokenizer
        self.tokenizer = tokenizer
        self.sentinels = list(getattr(tokenizer, "additional_special_tokens_ids", None) or [])
        if not self.sentinels:
            raise ConfigError("tokenizer.vocab_extra_ids=0: the T5 dataset needs sentinel tokens; set it to e.g. 100")
        for role in ("bos", "eos", "pad"):
            if getattr(tokenizer, role, None) is None:
                raise ConfigError(f"the T5 dataset needs a tokenizer with a {role} token (tokenizer.vocab_extra_ids adds "
                                  "bos/eos when missing)")
        self._pad_token_id = tokenizer.pad
        if self._pad_token_id in (tokenizer.eos, tokenizer.bos, *self.sentinels):
            raise ConfigError(f"the tokenizer's pad id {self._pad_token_id} is also another special token")
        _check_masking_config(config)
        if len(indexed_indices) == 0:
            self.sample_index = np.zeros((0, 3), dtype=np.int64)
            return
        bounds = indexed_dataset.document_indices[np.append(indexed_indices, indexed_indices[-1] + 1)]
        epochs, max_samples = (np.iinfo(np.int32).max - 1, num_samples) if num_samples is not None else (1, 2**63)
        # Room for the decoder's bos and eos (megatron-core's choice: sequence_length - 2).
        self.sample_index = build_sample_mapping(bounds, indexed_dataset.sequence_lengths, epochs, max_samples,
                                                 int(config.sequence_length) - 2,
                                                 float(config.short_sequence_probability), int(config.random_seed), 1)

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: IndexedDataset) -> int:
        """Masked-LM datasets split by document."""
        return int(low_level_dataset.document_indices.shape[0] - 1)

    @staticmethod
    def build_low_level_dataset(dataset_path: str, config: T5MaskedWordPieceDatasetConfig) -> IndexedDataset:
        """Open the ``.bin``/``.idx`` pair at ``dataset_path``."""
        if dataset_path is None:
            raise DataError("the T5 dataset needs data (dataset.data_path or dataset.blend); mock data is not supported")
        return IndexedDataset(dataset_path, multimodal=False, mmap=bool(config.mmap_bin_files))

    def __len__(self) -> int:
        return int(self.sample_index.shape[0])

    def __getitem__(self, idx: int) -> Dict[str, torch.Tensor]:
        first, end, target_length = (int(x) for x in self.sample_index[idx])
        rng = np.random.RandomState(seed=(int(self.config.random_seed) + idx) % 2**32)
        tokens = [int(t) for i in range(first, end) for t in self.dataset[i]]
        truncated = len(tokens) > target_length
        tokens = tokens[:target_length]
        tokens, spans = mask_spans(tokens, target_length, rng, self.config, self.tokenizer,
                                   permutation_size_rng(int(self.config.random_seed), idx))
        return self._build_sample(tokens, spans, truncated)

    def _build_sample(self, tokens: List[int], spans: List[Tuple[List[int], List[int]]],
                      truncated: bool) -> Dict[str, torch.Tensor]:
        tok = self.tokenizer
        sentinels = deque(self.sentinels)
        encoder_input: List[int] = []
        decoder_input: List[int] = [tok.bos]
        decoder_output: List[int] = []
        start = 0
        for positions, labels in spans:
            if not sentinels:
                raise DataError(f"a T5 sample has more masked spans than the {len(self.sentinels)} sentinel tokens: "
                                "raise tokenizer.vocab_extra_ids")
            sentinel = sentinels.popleft()
            encoder_input += tokens[start: positions[0]] + [sentinel]
            decoder_input += [sentinel] + labels
            decoder_output += [sentinel] + labels
            start = positions[-1] + 1
        encoder_input += tokens[start:]
        decoder_output.append(tok.eos)
        enc_len, dec_len = int(self.config.sequence_length), int(self.config.sequence_length_decoder)
        if len(encoder_input) > enc_len or len(decoder_input) > dec_len:
            raise DataError(
                f"a T5 sample needs {len(decoder_input)} decoder tokens but dataset.sequence_length_decoder={dec_len}: "
                "raise it (or lower masking_probability)"
            )
        pad = self._pad_token_id
        enc = np.array(encoder_input + [pad] * (enc_len - len(encoder_input)), dtype=np.int64)
        dec = np.array(decoder_input + [pad] * (dec_len - len(decoder_input)), dtype=np.int64)
        labels = np.array(decoder_output + [-1] * (dec_len - len(decoder_output)), dtype=np.int64)
        loss_mask = np.zeros(dec_len, dtype=np.int64)
        loss_mask[: len(decoder_input)] = 1
        enc_mask = (enc != pad).astype(np.int64)
        dec_mask = (dec != pad).astype(np.int64)
        enc[enc == pad] = 0  # padding ids must still be valid embedding rows
        dec[dec == pad] = 0
        labels[labels == pad] = 0
        sample = dict(text_enc=enc, text_dec=dec, labels=labels, loss_mask=loss_mask, enc_mask=enc_mask,
                      dec_mask=dec_mask)
        out = {k: torch.from_numpy(v) for k, v in sample.items()}
        out["truncated"] = torch.tensor(int(truncated))
        return out


def _check_masking_config(config: T5MaskedWordPieceDatasetConfig) -> None:
    p = config.masking_probability
    if not 0.0 < p < 1.0:
        raise ConfigError(f"dataset.masking_probability={p} must be in (0, 1)")
    q = config.short_sequence_probability
    if not 0.0 <= q <= 1.0:
        raise ConfigError(f"dataset.short_sequence_probability={q} must be in [0, 1]")
    if config.masking_max_ngram < 1:
        raise ConfigError(f"dataset.masking_max_ngram={config.masking_max_ngram} must be >= 1")
    check_masking_choices(config)
    if config.sequence_length_decoder is None or config.sequence_length_decoder < 2:
        raise ConfigError(f"dataset.sequence_length_decoder={config.sequence_length_decoder} must be >= 2")

