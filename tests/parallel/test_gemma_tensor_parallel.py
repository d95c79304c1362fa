"""Gemma / OLMo-2 layers under tensor parallel (TP2, TP2+SP on 2 gloo ranks): the norms after attention and the
MLP, zero-centred norms, per-head QK-norm (its weight's gradient summed over the ranks' heads), QK-norm across
heads (its weight split with the heads, its mean square summed over the ranks), embedding
scaling, soft-caps, sliding windows with a local RoPE base give the whole model's loss and gradients."""

from __future__ import annotations

import pytest

from tests.parallel.harness import get_shared_pool, init_gloo
from tests.parallel.test_tp_plans import small_provider

GEMMA_LIKE = dict(layernorm_zero_centered_gamma=True, layernorm_after_sublayers=True, apply_embedding_scaling=True,
                  qk_layernorm=True, attn_logit_softcapping=2.0, final_logit_softcapping=3.0, window_size=[3, 0],
                  window_attn_skip_freq=[1, 0], rotary_base=[10000, 1000000], rope_scaling_factor=8.0)
GEMMA_TIED = dict(GEMMA_LIKE, share_embeddings_and_output_weights=True)
OLMO2_LIKE = dict(layernorm_before_sublayers=False, layernorm_after_sublayers=True, qk_layernorm=True)
# QK-norm over the whole projections (OLMo-2, OLMoE, MiniMax-M2): split with the heads, squares summed over ranks
ACROSS_HEADS = dict(OLMO2_LIKE, qk_layernorm_across_heads=True)


def _loss_and_grads(fields: dict, sequence_parallel: bool) -> tuple[float, float]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, distribute_tensor

    from longspan.models.gpt import build_gpt_model, init_weights
    from longspan.parallel.loss_parallel import parallel_loss_context
    from longspan.parallel.tensor_parallel import apply_tensor_parallel

    init_gloo(timeout_s=60)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    provider = small_provider(**fields)
    whole = build_gpt_model(provider, seed=5, device="cpu")
    split = apply_tensor_parallel(build_gpt_model(provider, materialize=False), mesh, sequence_parallel)
    init_weights(split, seed=5, device="cpu")
    with torch.no_grad():  # norm weights away from their init, the same on every rank
        for model in (whole, split):
            for name, p in model.named_parameters():
                if "layernorm" in name:
                    full = torch.linspace(-0.5, 0.5, p.shape[0])
                    if isinstance(p, DTensor):  # replicated, or split by heads (QK-norm across heads)
                        full = distribute_tensor(full, p.device_mesh, p.placements).to_local()
                    (p.to_local() if isinstance(p, DTensor) else p).copy_(full)
    g = torch.Generator().manual_seed(0)
    tokens, labels = (torch.randint(0, 250, (2, 16), generator=g) for _ in range(2))
    ref = whole(tokens, labels=labels)
    ref.mean().backward()
    with parallel_loss_context(split):
        loss = split(tokens, labels=labels)
        loss.mean().backward()
    whole_params = dict(whole.named_parameters())
    grad_diff = 0.0
    for name, p in split.named_parameters():
        g_full = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        grad_diff = max(grad_diff, float((g_full - whole_params[name].grad).abs().max()))
    return float((loss - ref).detach().abs().max()), grad_diff


@pytest.mark.slow
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2_sp"])
@pytest.mark.parametrize("fields", [GEMMA_LIKE, GEMMA_TIED, OLMO2_LIKE, ACROSS_HEADS],
                         ids=["gemma", "gemma_tied", "olmo2_placement", "qk_norm_across_heads"])
def test_gemma_layers_split_match_whole_model(fields, sequence_parallel):
    for loss_diff, grad_diff in get_shared_pool(2).run(_loss_and_grads, fields, sequence_parallel, timeout=180):
        assert loss_diff < 1e-5 and grad_diff < 1e-5, (loss_diff, grad_diff)
