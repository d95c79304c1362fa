"""Output projection + cross-entropy over chunks of tokens, without the ``[tokens, vocab]`` logits.

``linear_cross_entropy(hidden, weight, labels)`` returns the same per-token losses as
``F.cross_entropy(F.linear(hidden, weight).float(), labels, reduction="none")`` and the same gradients, but
only one chunk of logits (``chunk_tokens x vocab``) exists at a time: the forward keeps the per-token
log-sum-exp (``[tokens]`` floats), and the backward recomputes each chunk's logits to form
``softmax - one_hot`` and its two matmuls. That costs one extra output-layer matmul per step and saves the
full logits, their float32 copy and their gradient (at vocab 128k, 4 x 2048 tokens: 3 x 4 GiB in float32).

The softmax always runs in float32 (the logits of a chunk are upcast), so ``fp16_lm_cross_entropy`` has no
effect on this path. Labels equal to ``ignore_index`` (-100, as ``F.cross_entropy``) get loss 0 and no gradient.

The maths is written for a vocabulary shard too (``vocab_start`` and the two reductions): the vocab-parallel
form under tensor parallel (``longspan.parallel.loss_parallel``) passes its process group's all-reduces in,
so the model code here stays free of process groups.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

#: Budget for one chunk's float32 logits; the chunk length in tokens follows from the vocabulary size.
DEFAULT_CHUNK_BYTES = 256 * 1024 * 1024
IGNORE_INDEX = -100

ReduceFn = Callable[[torch.Tensor], torch.Tensor]  # in-place all-reduce over the vocab shards, returns its input


def default_chunk_tokens(vocab_size: int, chunk_bytes: Optional[int] = None) -> int:
    """Tokens per chunk so that a chunk's float32 logits take at most ``chunk_bytes`` (default
    ``DEFAULT_CHUNK_BYTES``, read at call time); at least 1 token."""
    budget = DEFAULT_CHUNK_BYTES if chunk_bytes is None else int(chunk_bytes)
    return max(1, budget // (4 * max(1, int(vocab_size))))


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_tokens, vocab_start, reduce_max, reduce_sum):  # type: ignore[override]
        num_tokens = hidden.shape[0]
        local_vocab = weight.shape[0]
        local_lse = torch.empty(num_tokens, dtype=torch.float32, device=hidden.device)
        target_logit = torch.zeros(num_tokens, dtype=torch.float32, device=hidden.device)
        local_labels = labels - vocab_start
        in_shard = (local_labels >= 0) & (local_labels < local_vocab)
        safe_labels = torch.where(in_shard, local_labels, torch.zeros_like(local_labels))
        for start in range(0, num_tokens, chunk_tokens):
            end = min(start + chunk_tokens, num_tokens)
            logits = F.linear(hidden[start:end], weight).float()
            local_lse[start:end] = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, safe_labels[start:end].unsqueeze(1)).squeeze(1)
            target_logit[start:end] = torch.where(in_shard[start:end], picked, torch.zeros_like(picked))
        if reduce_max is None:
            lse = local_lse
        else:  # log Σ_shards exp(lse_shard), stabilised by the largest shard's value
            top = reduce_max(local_lse.clone())
            sums = torch.stack([torch.exp(local_lse - top), target_logit])
            reduce_sum(sums)
            lse = top + torch.log(sums[0])
            target_logit = sums[1]
        valid = labels != IGNORE_INDEX
        losses = torch.where(valid, lse - target_logit, torch.zeros_like(lse))
        ctx.save_for_backward(hidden, weight, safe_labels, in_shard & valid, valid, lse)
        ctx.chunk_tokens = chunk_tokens
        ctx.reduce_sum = reduce_sum
        return losses

    @staticmethod
    def backward(ctx, grad_losses):  # type: ignore[override]
        hidden, weight, safe_labels, target_here, valid, lse = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        scale = torch.where(valid, grad_losses.float(), torch.zeros_like(lse))
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        num_tokens = hidden.shape[0]
        for start in range(0, num_tokens, ctx.chunk_tokens):
            end = min(start + ctx.chunk_tokens, num_tokens)
            chunk = hidden[start:end]
            # d loss / d logits = (softmax - one_hot(label)) * grad, recomputed from the saved log-sum-exp
            grad_logits = torch.exp(F.linear(chunk, weight).float() - lse[start:end].unsqueeze(1))
            rows = torch.nonzero(target_here[start:end]).squeeze(1)
            grad_logits[rows, safe_labels[start:end][rows]] -= 1.0
            grad_logits.mul_(scale[start:end].unsqueeze(1))
            grad_logits = grad_logits.to(weight.dtype)
            if need_hidden:
                grad_hidden[start:end] = grad_logits @ weight
            if need_weight:
                if weight.dtype == torch.float32:
                    grad_weight.addmm_(grad_logits.t(), chunk)
                else:  # low-precision matmul per chunk, summed over chunks in float32
                    grad_weight += (grad_logits.t() @ chunk).float()
        if need_hidden and ctx.reduce_sum is not None:
            ctx.reduce_sum(grad_hidden)  # each vocab shard contributes a partial sum to d loss / d hidden
        if need_weight:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_tokens: Optional[int] = None,
    vocab_start: int = 0,
    reduce_max: Optional[ReduceFn] = None,
    reduce_sum: Optional[ReduceFn] = None,
) -> torch.Tensor:
    """Per-token float32 cross-entropy of ``hidden @ weight.T`` against ``labels``, chunked over tokens.

    Args:
        hidden: ``[..., h]`` hidden states (any leading shape; the result has that shape).
        weight: ``[vocab, h]`` output projection (a vocabulary shard ``[vocab/tp, h]`` with the reductions).
        labels: ``[...]`` target ids (global ids); ``-100`` is ignored.
        chunk_tokens: tokens per chunk; default ``default_chunk_tokens(weight.shape[0])``.
        vocab_start: the first global id of ``weight``'s shard.
        reduce_max, reduce_sum: in-place all-reduces (max, sum) over the vocabulary shards; None on one shard.

    Under ``torch.autocast`` the matmuls run in the autocast dtype, as ``F.linear`` would.
    """
    if (reduce_max is None) != (reduce_sum is None):
        raise ValueError("linear_cross_entropy: pass both reduce_max and reduce_sum, or neither")
    lead_shape = labels.shape
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_labels = labels.reshape(-1)
    device_type = flat_hidden.device.type
    if device_type == "meta":  # shape-only runs (longspan plan): autocast has no meta device
        device_type = "cpu"
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        flat_hidden, weight = flat_hidden.to(dtype), weight.to(dtype)
    chunk = int(chunk_tokens) if chunk_tokens else default_chunk_tokens(weight.shape[0])
    if chunk < 1:
        raise ValueError(f"linear_cross_entropy: chunk_tokens={chunk_tokens} must be >= 1")
    with torch.autocast(device_type, enabled=False):
        losses = _ChunkedLinearCrossEntropy.apply(
            flat_hidden, weight, flat_labels, chunk, int(vocab_start), reduce_max, reduce_sum
        )
    return losses.view(lead_shape)


def _storage_refs(tensor: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


class LogitsWorkspace:
    """Reused ``[tokens, vocab]`` float32 buffers for ``fused_linear_cross_entropy`` on a CPU (a model keeps one).

    Why: a fresh 256 MiB tensor costs a CPU ~0.12 s of page faults when first written (measured on the
    benchmark shape's logits, one thread), more than the log-softmax itself; on CUDA the caching allocator
    already reuses memory, so there every buffer is a plain ``torch.empty``. A buffer is handed out again only
    when nothing but the workspace references its storage, i.e. after the backward that used it has released
    its saved tensors (``retain_graph`` keeps it taken). At most ``max_buffers`` are kept (two per step; more
    with several microbatches in flight); buffers of another shape are dropped once free.
    """

    def __init__(self, max_buffers: int = 4) -> None:
        self.max_buffers = max_buffers
        self._buffers: list[tuple[torch.Tensor, int]] = []  # (buffer, its storage's reference count when free)

    def take(self, shape: tuple[int, int], device: torch.device) -> torch.Tensor:
        """An uninitialised float32 tensor of ``shape`` (a view of a kept buffer when one is free)."""
        if device.type != "cpu" or torch.compiler.is_compiling() or not hasattr(torch._C, "_storage_Use_Count"):
            return torch.empty(shape, dtype=torch.float32, device=device)
        free = [(buf, refs) for buf, refs in self._buffers if _storage_refs(buf) == refs]
        for buf, _ in free:
            if tuple(buf.shape) == tuple(shape):
                return buf.view(buf.shape)
        stale = {id(buf) for buf, _ in free}  # free, of another shape: let them go
        self._buffers = [(buf, refs) for buf, refs in self._buffers if id(buf) not in stale]
        buf = torch.empty(shape, dtype=torch.float32, device=device)
        if len(self._buffers) < self.max_buffers:
            self._buffers.append((buf, _storage_refs(buf)))
        return buf.view(buf.shape)

    def __deepcopy__(self, memo: dict) -> "LogitsWorkspace":
        return LogitsWorkspace(self.max_buffers)  # a copied model starts with its own, empty workspace

    def __getstate__(self) -> dict:
        return {"max_buffers": self.max_buffers, "_buffers": []}  # a pickled model carries no scratch memory


class _LinearCrossEntropyGradInForward(torch.autograd.Function):
    """Output projection + cross-entropy as one autograd node whose forward also forms d loss / d logits.

    Forward: ``logits = hidden @ weight.T``, ``log_probs = log_softmax(logits)`` (the logits are freed),
    ``loss = -log_probs[label]`` (what ``F.cross_entropy`` computes), then the log-probabilities become
    ``softmax - one_hot(label)`` in place. Backward scales rows by the incoming per-token gradients:
    ``d hidden = g * (P @ weight)`` and ``d weight = P.T @ (g * hidden)``, so no ``[tokens, vocab]`` pass is
    left for it. Against the plain path (log_softmax, nll_loss, and in backward a zero-filled
    ``[tokens, vocab]`` gradient through ``log_softmax_backward``) that saves two full passes over the logits
    and one ``[tokens, vocab]`` buffer.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, workspace):  # type: ignore[override]
        shape = (hidden.shape[0], weight.shape[0])
        take = workspace.take if workspace is not None else (
            lambda size, device: torch.empty(size, dtype=torch.float32, device=device))
        logits = torch.mm(hidden, weight.t(), out=take(shape, hidden.device))
        log_probs = torch.log_softmax(logits, dim=-1, out=take(shape, hidden.device))
        del logits  # back to the workspace
        valid = labels != IGNORE_INDEX
        safe_labels = torch.where(valid, labels, torch.zeros_like(labels)).unsqueeze(1)
        picked = log_probs.gather(1, safe_labels).squeeze(1)
        losses = torch.where(valid, -picked, torch.zeros_like(picked))
        grad_logits = log_probs.exp_()
        grad_logits.scatter_add_(1, safe_labels, torch.full_like(picked, -1.0).unsqueeze(1))
        ctx.save_for_backward(hidden, weight, grad_logits, valid)
        return losses

    @staticmethod
    def backward(ctx, grad_losses):  # type: ignore[override]
        hidden, weight, grad_logits, valid = ctx.saved_tensors
        scale = torch.where(valid, grad_losses, torch.zeros_like(grad_losses)).unsqueeze(1)
        grad_hidden = torch.mm(grad_logits, weight).mul_(scale) if ctx.needs_input_grad[0] else None
        grad_weight = torch.mm(grad_logits.t(), hidden * scale) if ctx.needs_input_grad[1] else None
        return grad_hidden, grad_weight, None, None


def fused_linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, workspace: Optional[LogitsWorkspace] = None
) -> torch.Tensor:
    """Per-token float32 cross-entropy of ``hidden @ weight.T`` against ``labels`` (``-100`` ignored): the losses
    of ``F.cross_entropy(F.linear(hidden, weight), labels, reduction="none")`` and their gradients (within
    float32 rounding), with the gradient of the logits formed during the forward
    (``_LinearCrossEntropyGradInForward``). For float32 plain tensors; ``hidden`` ``[..., h]``, ``labels``
    ``[...]``; ``workspace`` reuses the ``[tokens, vocab]`` buffers across steps. Unlike ``linear_cross_entropy``
    it holds one ``[tokens, vocab]`` buffer until the backward (and recomputes nothing): the faster choice where
    that buffer fits."""
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    losses = _LinearCrossEntropyGradInForward.apply(flat_hidden, weight, labels.reshape(-1), workspace)
    return losses.view(labels.shape)
