"""The vocab-parallel cross-entropy switch for forward *and* backward.

Under tensor parallel the output layer returns vocab-sharded logits (DTensor ``Shard(-1)``). Inside
``torch.distributed.tensor.parallel.loss_parallel()`` the model's ``F.cross_entropy`` runs on the shards
(an all-reduce of the max and of the sum of exponentials per token) instead of gathering the full
vocabulary. The backward of that loss must run inside the same context, so the trainer wraps each
microbatch's forward *and* ``loss.backward()`` in ``parallel_loss_context(model)``.

Outside the context the output layer gathers the full logits first, so the loss is still correct: the
context is about memory and communication, not about the maths. The context is re-entrant (only the outermost
one switches torch's handlers) and always switches them off again, also when the body raises.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

from torch.distributed.tensor.parallel import loss_parallel

from longspan.parallel.tensor_parallel import LOSS_PARALLEL_ATTR


def _unwrap(module: Any) -> Any:
    while hasattr(module, "module") and not hasattr(module, LOSS_PARALLEL_ATTR):
        module = module.module  # DDP and similar wrappers
    return module


def uses_loss_parallel(model_or_parallel: Any) -> bool:
    """Whether ``model_or_parallel`` needs ``loss_parallel()``.

    Accepts a model chunk (wrapped or not: true when its output layer is vocab-sharded), a list of chunks
    (any of them), a ``ParallelState`` (tp size > 1) or None (false).
    """
    if model_or_parallel is None:
        return False
    if isinstance(model_or_parallel, (list, tuple)):
        return any(uses_loss_parallel(m) for m in model_or_parallel)
    if hasattr(model_or_parallel, "tp_size") and not hasattr(model_or_parallel, "parameters"):
        return int(model_or_parallel.tp_size) > 1
    return bool(getattr(_unwrap(model_or_parallel), LOSS_PARALLEL_ATTR, False))


def parallel_loss_context(model_or_parallel: Any) -> contextlib.AbstractContextManager:
    """``torch.distributed.tensor.parallel.loss_parallel()`` when the model's logits are vocab-sharded,
    else a ``nullcontext``. Wrap a microbatch's forward and its ``backward()`` in it."""
    if not uses_loss_parallel(model_or_parallel):
        return contextlib.nullcontext()
    return _loss_parallel_once()


_state = threading.local()


@contextlib.contextmanager
def _loss_parallel_once() -> Iterator[None]:
    depth = getattr(_state, "depth", 0)
    if depth:  # torch's loss_parallel() must not nest: its inner exit would remove the outer's handlers
        _state.depth = depth + 1
        try:
            yield
        finally:
            _state.depth -= 1
        return

    context = loss_parallel()
    context.__enter__()
    _state.depth = 1
    try:
        yield
    finally:
        _state.depth = 0
        context.__exit__(None, None, None)  # torch's context has no try/finally: always switch off
