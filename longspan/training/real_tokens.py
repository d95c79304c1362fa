"""Real tokens of the training batches: what throughput, token counts and MFU count.

A real token is one the model attends over, padding left out (the prompt of an SFT sample counts, its padding
does not; loss tokens, Σloss_mask, are reported beside them as ``loss_tokens``). SFT batches carry their rows'
unpadded lengths (``real_tokens``, see ``longspan.data.sft.dataset``); a batch without them is counted whole
(pretraining data has no padding; an offline pack's trailing padding counts as tokens). ``RealTokenCounter``
wraps the training data iterator and counts each batch as it is handed out; the train step takes the counts
of its microbatches and sums them over the data-parallel ranks.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

import torch


def batch_token_counts(batch: Any) -> Optional[tuple[int, int, int]]:
    """(real tokens, Σ length², positions) of one microbatch, or None when it is not a dict of ``tokens`` (T5
    batches, ...); positions are the batch's width times its rows, padding included."""
    if not isinstance(batch, dict) or not isinstance(batch.get("tokens"), torch.Tensor):
        return None
    tokens = batch["tokens"]
    b, s = (int(tokens.shape[0]), int(tokens.shape[1])) if tokens.dim() >= 2 else (1, int(tokens.numel()))
    rows = batch.get("real_tokens")
    if isinstance(rows, torch.Tensor):
        lengths = rows.to(torch.int64).reshape(-1)
        return int(lengths.sum()), int((lengths * lengths).sum()), b * s
    return b * s, b * s * s, b * s


class RealTokenCounter:
    """A data iterator that counts the real tokens of the batches it hands out (``take`` reads and resets)."""

    def __init__(self, iterator: Iterator) -> None:
        self.iterator = iterator
        self._counts = [0, 0, 0]
        self._known = True

    def __iter__(self) -> "RealTokenCounter":
        return self

    def __next__(self) -> Any:
        batch = next(self.iterator)
        counts = batch_token_counts(batch)
        if counts is None:
            self._known = False
        else:
            self._counts = [a + b for a, b in zip(self._counts, counts)]
        return batch

    def __getattr__(self, name: str) -> Any:
        # what the loop asks of the wrapped iterator (a replayable iterator's advance(), a loader's state)
        if name == "iterator":  # not set yet (copying): no recursion
            raise AttributeError(name)
        return getattr(self.iterator, name)

    def take(self) -> Optional[tuple[int, int, int]]:
        """(real tokens, Σ length², positions) since the last call, or None when a batch could not be counted."""
        counts = tuple(self._counts) if self._known else None
        self._counts, self._known = [0, 0, 0], True
        return counts  # type: ignore[return-value]


def count_real_tokens(data_iterator: Any) -> tuple[Any, Optional[RealTokenCounter]]:
    """(the iterator to train from, its counter): the first iterator counts (every virtual pipeline chunk reads
    the same batches); None, or an iterator of nothing, is left as it is."""
    if data_iterator is None:
        return None, None
    if isinstance(data_iterator, list):
        if not data_iterator or data_iterator[0] is None:
            return data_iterator, None
        counter = RealTokenCounter(data_iterator[0])
        return [counter, *data_iterator[1:]], counter
    counter = RealTokenCounter(data_iterator)
    return counter, counter


def global_token_counts(counter: Optional[RealTokenCounter], parallel: Any,
                        device: torch.device) -> Optional[tuple[int, int, int]]:
    """The step's (real tokens, Σ length², positions) over the data-parallel ranks (collective when dp > 1)."""
    counts = counter.take() if counter is not None else None
    if parallel.dp_size <= 1:
        return counts
    values = [0, 0, 0, 1] if counts is None else [*counts, 0]  # the last: ranks that could not count
    total = torch.tensor(values, dtype=torch.int64, device=device)
    torch.distributed.all_reduce(total, group=parallel.dp_group)
    return None if int(total[3]) else (int(total[0]), int(total[1]), int(total[2]))
