"""The Mamba tensor-parallel plan (longspan.parallel.mamba) at model level on 2 ranks.

Each rank computes half of the heads (checked through the sizes it computes with), the loss equals one
process's, and every rank ends the backward with the full one-process gradient of every parameter (the
mixer's replicated parameters get the sum of the ranks' slices).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from longspan.core.errors import ConfigError, NotSupportedError
from longspan.models.mamba import build_mamba_model
from longspan.parallel.mamba import apply_mamba_tensor_parallel
from tests.models.mamba.mamba_test_config import hybrid_config
from tests.parallel.harness import get_shared_pool


def _tp2_case() -> dict:
    import torch
    from torch.distributed.tensor import DTensor

    from longspan.models.init import init_weights
    from longspan.models.mamba import build_mamba_model
    from longspan.parallel.init import initialize_distributed
    from longspan.parallel.parallelize import parallel_loss_context, parallelize_model
    from longspan.training.config import ConfigContainer, DistributedInitConfig

    provider = hybrid_config(tensor_model_parallel_size=2, vocab_size=128)
    cfg = ConfigContainer(model=provider, dist=DistributedInitConfig(distributed_backend="gloo"))
    parallel = initialize_distributed(cfg.dist, provider, device="cpu")
    ids = torch.randint(0, 128, (2, 21), generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, 128, (2, 21), generator=torch.Generator().manual_seed(1))

    reference = build_mamba_model(provider, seed=11)
    ref_loss = reference(ids, labels=labels)
    ref_loss.mean().backward()

    model = parallelize_model(build_mamba_model(provider, materialize=False), cfg, parallel)
    init_weights(model, seed=11, device="cpu")
    mixer = model.decoder.layers["0"].mixer
    local = mixer.local_parameters()
    with parallel_loss_context(model):
        loss = model(ids, labels=labels)
        loss.mean().backward()
    ref_grads = dict(reference.named_parameters())
    worst = 0.0
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        worst = max(worst, (grad - ref_grads[name].grad).abs().max().item())
    return {"heads": (local.heads, local.groups, local.d_inner, tuple(local.in_proj.shape)),
            "full_heads": mixer.heads, "loss": (loss - ref_loss).abs().max().item(), "grad": worst}


@pytest.mark.slow
def test_tp2_splits_heads_and_matches_one_process() -> None:
    for result in get_shared_pool(2).run(_tp2_case, timeout=120):
        d_inner, groups, state, heads = 64, 2, 8, 8
        local_rows = (2 * d_inner + 2 * groups * state + heads) // 2
        assert result["heads"] == (heads // 2, groups // 2, d_inner // 2, (local_rows, 32))
        assert result["full_heads"] == heads
        assert result["loss"] <= 1e-5
        assert result["grad"] <= 1e-6


def test_sequence_parallel_and_indivisible_heads_are_one_line_errors() -> None:
    mesh = SimpleNamespace(size=lambda: 2)
    with pytest.raises(NotSupportedError, match="sequence_parallel=True with Mamba layers"):
        apply_mamba_tensor_parallel(build_mamba_model(hybrid_config(), materialize=False), mesh, True)
    model = build_mamba_model(hybrid_config(mamba_num_groups=1), materialize=False)
    with pytest.raises(ConfigError, match="mamba_num_groups=1"):
        apply_mamba_tensor_parallel(model, mesh)
