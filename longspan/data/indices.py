"""Vectorized builders of the GPT and blending indices, equal element for element to megatron-core's.

megatron-core builds the sample index and the blending index with C++ loops over samples. Here the sample
index is a ``searchsorted`` over cumulative document lengths (each sample starts ``sequence_length`` tokens
after the previous one), and the greedy blending order is predicted in bulk, checked in bulk against the
greedy rule, and repaired where the prediction was wrong (exact and fast for two datasets; three or more
are walked sample by sample). The sample index takes seconds on billions of tokens.
"""

from __future__ import annotations

from typing import Optional, Tuple

import numpy as np


def num_epochs_for(num_tokens_per_epoch: int, num_samples: Optional[int], seq_length: int, extra: int) -> int:
    """Smallest number of epochs (at least 1) holding ``num_samples * seq_length + extra`` tokens."""
    if num_samples is None:
        return 1
    requested = num_samples * seq_length + extra
    return max(1, -(-requested // num_tokens_per_epoch))


def build_document_index(
    documents: np.ndarray, num_epochs: int, rng: np.random.RandomState, separate_final_epoch: bool
) -> np.ndarray:
    """Documents tiled ``num_epochs`` times and shuffled (the last epoch on its own when separate)."""
    if not separate_final_epoch or num_epochs == 1:
        index = np.tile(np.asarray(documents, dtype=np.int32), num_epochs)
        rng.shuffle(index)
        return index
    first = build_document_index(documents, num_epochs - 1, rng, False)
    last = build_document_index(documents, 1, rng, False)
    return np.concatenate((first, last))


def build_sample_index(
    sizes: np.ndarray,
    document_index: np.ndarray,
    seq_length: int,
    num_epochs: int,
    tokens_per_epoch: int,
    drop_last_partial_sequence: bool = True,
    add_extra_token: bool = True,
) -> np.ndarray:
    """The ``[num_samples + 1, 2]`` array of (document-index position, token offset) where samples start.

    Sample ``i`` starts at token ``i * seq_length`` of the concatenated documents and reads
    ``seq_length + E`` tokens (E = 1 with the extra token); row ``i + 1`` marks its end. A row sits on the
    first document whose end is at or past the sample's end position minus nothing, i.e. the first document
    with ``end >= start + E``; past the last document the row is (last, len(last) - E).
    """
    extra = 1 if add_extra_token else 0
    total = num_epochs * tokens_per_epoch - extra
    if drop_last_partial_sequence:
        num_samples = total // seq_length
    else:
        # megatron-core computes this ceil in single precision; so do we, to agree on huge datasets.
        num_samples = int(np.ceil(np.float32(total) / np.float32(seq_length)))
    index_dtype = np.int32
    if max(len(document_index), int(sizes.max()) if len(sizes) else 0) > np.iinfo(np.int32).max:
        index_dtype = np.int64
    doc_lengths = sizes[document_index].astype(np.int64)
    doc_ends = np.cumsum(doc_lengths)
    starts = np.arange(1, num_samples + 1, dtype=np.int64) * seq_length
    rows = np.searchsorted(doc_ends, starts + extra, side="left")
    past_end = rows >= len(document_index)
    rows = np.minimum(rows, len(document_index) - 1)
    offsets = starts - (doc_ends[rows] - doc_lengths[rows])
    offsets[past_end] = doc_lengths[-1] - extra
    sample_index = np.empty((num_samples + 1, 2), dtype=index_dtype)
    sample_index[0] = 0
    sample_index[1:, 0] = rows
    sample_index[1:, 1] = offsets
    return sample_index


def build_shuffle_index(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    """``arange(num_samples)`` shuffled, followed by ``arange(num_samples, total_size)`` shuffled."""
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


# ----------------------------------------------------------------------------------------------------------
# Blending: for sample s pick the dataset i maximizing w_i * max(s, 1) - taken_i (ties -> lowest index).


def _greedy_steps(weights: np.ndarray, counts: np.ndarray, start: int, steps: int, out: np.ndarray) -> None:
    """The greedy rule, one sample at a time (used only to repair a wrong bulk prediction)."""
    w = weights.tolist()
    c = counts.tolist()
    k = len(w)
    for n in range(steps):
        s = max(float(start + n), 1.0)
        best, best_err = 0, w[0] * s - c[0]
        for i in range(1, k):
            err = w[i] * s - c[i]
            if err > best_err:
                best, best_err = i, err
        out[n] = best
        c[best] += 1
    counts[:] = c


def _predict(weights: np.ndarray, counts: np.ndarray, start: int, steps: int) -> np.ndarray:
    """Bulk guess of the next ``steps`` picks: dataset i's next picks fall at steps ~ (taken + k) / w_i."""
    keys, ids = [], []
    for i, w in enumerate(weights):
        if w <= 0:
            continue
        m = int(w * (start + steps)) - int(counts[i]) + 2
        if m <= 0:
            continue
        k = np.arange(m, dtype=np.float64) + counts[i]
        keys.append(k / w)
        ids.append(np.full(m, i, dtype=np.int64))
    all_keys, all_ids = np.concatenate(keys), np.concatenate(ids)
    order = np.lexsort((all_ids, all_keys))[:steps]
    guess = all_ids[order]
    if len(guess) < steps:  # cannot happen with the +2 margin, but never return a short block
        guess = np.concatenate([guess, np.zeros(steps - len(guess), dtype=np.int64)])
    return guess


def _first_mismatch(weights: np.ndarray, counts: np.ndarray, start: int, picks: np.ndarray) -> int:
    """Index of the first pick that breaks the greedy rule, or len(picks) when all follow it."""
    steps = len(picks)
    k = len(weights)
    onehot = np.zeros((k, steps), dtype=np.int64)
    onehot[picks, np.arange(steps)] = 1
    taken = np.cumsum(onehot, axis=1) - onehot + counts[:, None]  # taken before each step
    s = np.maximum(np.arange(start, start + steps, dtype=np.float64), 1.0)
    errors = weights[:, None] * s[None, :] - taken.astype(np.float64)
    ok = np.argmax(errors, axis=0) == picks  # argmax returns the first maximum, like the strict '>'
    bad = np.flatnonzero(~ok)
    return int(bad[0]) if len(bad) else steps


def build_blending_indices(weights: np.ndarray, size: int) -> Tuple[np.ndarray, np.ndarray]:
    """(dataset_index int16, dataset_sample_index int64) of megatron-core's greedy blend of ``size`` samples."""
    w = np.asarray(weights, dtype=np.float64)
    k = len(w)
    dataset_index = np.zeros(size, dtype=np.int16)
    counts = np.zeros(k, dtype=np.int64)
    if k > 2:
        # With three or more datasets the greedy order has no cheap closed-form guess (the bulk prediction
        # fails every few steps), so walk it directly: about a microsecond per sample and dataset.
        picks = np.empty(size, dtype=np.int64)
        _greedy_steps(w, counts, 0, size, picks)
        dataset_index[:] = picks
        return dataset_index, _running_count(dataset_index, k)
    pos = 0
    window = 4096  # adapts to how far the bulk prediction stays right
    picks_buf = np.empty(0, dtype=np.int64)
    while pos < size:
        steps = min(window, size - pos)
        guess = _predict(w, counts, pos, steps)
        good = _first_mismatch(w, counts, pos, guess)
        dataset_index[pos : pos + good] = guess[:good]
        counts += np.bincount(guess[:good], minlength=k)
        pos += good
        if good == steps:
            window = min(window * 2, max(1 << 20, (1 << 24) // max(k, 1)))
            continue
        window = max(256, min(window, 4 * good))
        # Repair a short run one step at a time, then go back to bulk prediction.
        n = min(16, size - pos)
        if len(picks_buf) < n:
            picks_buf = np.empty(n, dtype=np.int64)
        _greedy_steps(w, counts, pos, n, picks_buf[:n])
        dataset_index[pos : pos + n] = picks_buf[:n]
        pos += n
    dataset_sample_index = _running_count(dataset_index, k)
    return dataset_index, dataset_sample_index


def _running_count(dataset_index: np.ndarray, k: int) -> np.ndarray:
    """For each position, how many earlier positions chose the same dataset."""
    out = np.zeros(len(dataset_index), dtype=np.int64)
    for i in range(k):
        where = np.flatnonzero(dataset_index == i)
        out[where] = np.arange(len(where), dtype=np.int64)
    return out


def build_exhaustive_blending_indices(sizes: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Blend exactly ``sizes[i]`` samples of each dataset, in proportion, until all are spent."""
    sizes = np.asarray(sizes, dtype=np.int64)
    total = int(sizes.sum())
    weights = (sizes / float(total)).tolist()
    taken = [0] * len(sizes)
    unspent = [i for i in range(len(sizes)) if sizes[i] > 0]
    dataset_index = np.zeros(total, dtype=np.int16)
    for s in range(total):
        sd = max(float(s), 1.0)
        best, best_err = -1, -np.inf
        for i in unspent:
            err = weights[i] * sd - taken[i]
            if err > best_err:
                best, best_err = i, err
        dataset_index[s] = best
        taken[best] += 1
        if taken[best] == sizes[best]:
            unspent.remove(best)
    return dataset_index, _running_count(dataset_index, len(sizes))
