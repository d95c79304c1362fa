"""Model + optimizer level training for layout-parity tests, with the trainer's loss maths.

The model is built as the trainer builds it (meta model -> ``parallelize_model`` -> ``init_weights``) and
trained on fixed global batches split Megatron's way: microbatch k of data-parallel rank r holds samples
``k·mbs·dp + r·mbs``; each microbatch's masked mean is divided by the number of microbatches, ``no_sync``
covers all but the last microbatch, and data parallelism averages the gradients.
"""

from __future__ import annotations

from typing import Any


def build_layout_model(cfg: Any, dp_replicate: int = 1) -> tuple[Any, Any, Any]:
    """(parallel state, model, optimizer) for this process's layout."""
    import torch

    from longspan.models.gpt import build_gpt_model, init_weights
    from longspan.parallel.init import initialize_distributed
    from longspan.parallel.parallelize import parallelize_model
    from longspan.training.optim.optimizer import get_megatron_optimizer

    parallel = initialize_distributed(cfg.dist, cfg.model, dp_replicate=dp_replicate, device="cpu")
    cfg.model.finalize()
    torch.manual_seed(1234)
    model = build_gpt_model(cfg.model, materialize=False)
    model = parallelize_model(model, cfg, parallel)
    init_weights(model, seed=cfg.rng.seed, device=parallel.device)
    model.train()
    return parallel, model, get_megatron_optimizer(cfg.optimizer, [model])


def train_on_global_batches(model: Any, optimizer: Any, parallel: Any, batches: list, gbs: int,
                            mbs: int) -> tuple[list[float], list[float]]:
    """Train one iteration per (text, loss_mask) global batch; (global losses, gradient norms) per iteration."""
    import contextlib

    import torch
    import torch.distributed as dist

    from longspan.parallel.parallelize import parallel_loss_context

    dp, dp_rank = parallel.dp_size, parallel.dp_rank
    num_mb = gbs // (mbs * dp)
    losses, norms = [], []
    for text, mask in batches:
        optimizer.zero_grad()
        mb_means = []
        for k in range(num_mb):
            start = k * mbs * dp + dp_rank * mbs
            tokens, labels = text[start:start + mbs, :-1], text[start:start + mbs, 1:]
            loss_mask = mask[start:start + mbs]
            last = k == num_mb - 1
            sync = contextlib.nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync()
            with sync, parallel_loss_context(model):
                per_token = model(tokens, labels=labels)
                mean = (per_token * loss_mask).sum() / loss_mask.sum()
                (mean / num_mb).backward()
            mb_means.append(mean.detach())
        _, norm, _ = optimizer.step()
        loss = torch.stack(mb_means).sum()
        if dp > 1:
            dist.all_reduce(loss, group=parallel.dp_group)
        losses.append(float(loss) / (num_mb * dp))
        norms.append(float(norm))
    return losses, norms
