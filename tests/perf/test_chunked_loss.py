"""Chunked linear + cross-entropy (longspan.models.loss, model.cross_entropy_loss_fusion): the same per-token
losses and gradients as the plain logits path, in one process and vocab-parallel under TP2 (with and
without sequence parallel), and a training step's peak memory at vocab 128k lower by about the logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from longspan.models import loss as loss_mod
from longspan.models.loss import linear_cross_entropy
from tests.parallel.harness import init_gloo
from tests.perf.peak_memory import peak_rss_delta


def _plain(hidden, weight, labels):
    return F.cross_entropy(F.linear(hidden, weight).float().flatten(0, 1), labels.flatten(), reduction="none")


@pytest.mark.parametrize("chunk", [1, 7, 64, None])
def test_equals_plain_loss_and_gradients(chunk):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 11, 16, generator=g, requires_grad=True)
    weight = torch.randn(200, 16, generator=g, requires_grad=True)
    labels = torch.randint(0, 200, (3, 11), generator=g)
    labels[0, :4] = -100  # ignored tokens: loss 0, no gradient
    grad_out = torch.rand(3, 11, generator=g)  # uneven per-token weights, as a loss mask would give

    ref = _plain(hidden, weight, labels).view(3, 11)
    ref_gh, ref_gw = torch.autograd.grad((ref * grad_out).sum(), (hidden, weight))
    out = linear_cross_entropy(hidden, weight, labels, chunk_tokens=chunk)
    gh, gw = torch.autograd.grad((out * grad_out).sum(), (hidden, weight))
    assert out.dtype == torch.float32 and out.shape == (3, 11)
    assert (out[0, :4] == 0).all()
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gh, ref_gh, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gw, ref_gw, rtol=1e-6, atol=1e-6)


def test_bf16_autocast_close_and_frozen_weight():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(40, 16, generator=g, requires_grad=True)
    weight = torch.randn(96, 16, generator=g)  # frozen (no grad): only the hidden gradient is formed
    labels = torch.randint(0, 96, (40,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = linear_cross_entropy(hidden, weight, labels, chunk_tokens=9)
        ref = F.cross_entropy(F.linear(hidden, weight).float(), labels, reduction="none")
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    (gh,) = torch.autograd.grad(out.sum(), hidden)
    assert gh.dtype == torch.float32 and torch.isfinite(gh).all()


def _model_pair(**overrides):
    from longspan.models.gpt import build_gpt_model
    from tests.parallel.test_tp_plans import small_provider

    plain = build_gpt_model(small_provider(**overrides), seed=3, device="cpu")
    fused = build_gpt_model(small_provider(cross_entropy_loss_fusion=True, **overrides), seed=3, device="cpu")
    return plain, fused


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_model_fused_loss_matches_plain(tied, monkeypatch):
    monkeypatch.setattr(loss_mod, "DEFAULT_CHUNK_BYTES", 4 * 256 * 5)  # 5 tokens per chunk: several chunks
    plain, fused = _model_pair(share_embeddings_and_output_weights=tied)
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 250, (2, 16), generator=g)
    labels = torch.randint(0, 250, (2, 16), generator=g)
    mask = (torch.rand(2, 16, generator=g) > 0.3).float()
    ref = plain(tokens, labels=labels)
    ((ref * mask).sum() / mask.sum()).backward()
    out = fused(tokens, labels=labels)
    ((out * mask).sum() / mask.sum()).backward()
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    grads = dict(plain.named_parameters())
    for name, p in fused.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-6, atol=1e-6, msg=name)
    with torch.no_grad():  # without labels the model still returns logits
        assert fused(tokens).shape == (2, 16, 256)


def test_te_impl_names_the_same_cross_entropy():
    """'te' names Transformer Engine's kernel for the same cross-entropy: the chunked loss computes it."""
    from longspan.models.gpt import build_gpt_model
    from tests.parallel.test_tp_plans import small_provider

    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    losses = [build_gpt_model(small_provider(cross_entropy_loss_fusion=True, cross_entropy_fusion_impl=impl),
                              seed=1, device="cpu")(tokens, labels=tokens) for impl in ("native", "te")]
    assert torch.equal(losses[0], losses[1])


def _tp_fused_checks(sequence_parallel: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import CommDebugMode

    from longspan.models import loss as loss_module
    from longspan.models.gpt import build_gpt_model, init_weights
    from longspan.parallel.loss_parallel import parallel_loss_context
    from longspan.parallel.tensor_parallel import apply_tensor_parallel
    from tests.parallel.test_tp_plans import small_provider

    loss_module.DEFAULT_CHUNK_BYTES = 4 * 128 * 6  # 6 tokens per chunk of the 128-row shard
    init_gloo(timeout_s=60)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    whole = build_gpt_model(small_provider(), seed=5, device="cpu")  # the plain loss, one process
    provider = small_provider(cross_entropy_loss_fusion=True)
    split = apply_tensor_parallel(build_gpt_model(provider, materialize=False), mesh, sequence_parallel)
    init_weights(split, seed=5, device="cpu")
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 250, (2, 16), generator=g)
    labels = torch.randint(0, 250, (2, 16), generator=g)
    labels[1, 3] = -100
    mask = (torch.rand(2, 16, generator=g) > 0.3).float()
    ref = whole(tokens, labels=labels)
    ((ref * mask).sum() / mask.sum()).backward()
    seen = []
    split.output_layer.register_forward_hook(lambda *a: seen.append(1))
    with CommDebugMode() as comm, parallel_loss_context(split):
        out = split(tokens, labels=labels)
        ((out * mask).sum() / mask.sum()).backward()
    grads = dict(whole.named_parameters())
    grad_diff = 0.0
    for name, p in split.named_parameters():
        full = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        grad_diff = max(grad_diff, float((full - grads[name].grad).abs().max()))
    counts = {str(k): v for k, v in comm.get_comm_counts().items()}
    return {
        "loss_diff": float((out - ref).detach().abs().max()),
        "grad_diff": grad_diff,
        "plain": not isinstance(out, DTensor),
        "output_layer_called": bool(seen),  # the full-logits matmul of the module never ran
        "weight_gathers": sum(v for k, v in counts.items() if "all_gather" in k and not sequence_parallel),
    }


@pytest.mark.slow
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2_sp"])
def test_vocab_parallel_fused_loss_matches_one_process(pool2, sequence_parallel):
    for r in pool2.run(_tp_fused_checks, sequence_parallel, timeout=180):
        assert r["plain"] and not r["output_layer_called"], r
        assert r["loss_diff"] <= 1e-6 and r["grad_diff"] <= 1e-6, r
        assert r["weight_gathers"] == 0, r


@pytest.mark.slow
def test_training_peak_memory_drops_by_the_logits_at_vocab_128k(monkeypatch):
    """One forward+backward of the output layer + loss over 512 tokens at vocab 131072, hidden 64."""
    monkeypatch.setattr(loss_mod, "DEFAULT_CHUNK_BYTES", 32 * 1024 * 1024)
    vocab, tokens, hidden_size = 131072, 512, 64
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, tokens // 2, hidden_size, generator=g, requires_grad=True)
    weight = (torch.randn(vocab, hidden_size, generator=g) * 0.02).requires_grad_()
    labels = torch.randint(0, vocab, (2, tokens // 2), generator=g)

    def step(fn):
        def run():
            hidden.grad = weight.grad = None
            fn(hidden, weight, labels).mean().backward()
            return hidden.grad.clone(), weight.grad.clone()
        return run

    step(_plain)(), step(linear_cross_entropy)()  # warm-up: allocator and weight.grad exist in both
    plain_peak, (ph, pw) = peak_rss_delta(step(lambda h, w, l: _plain(h, w, l)))
    fused_peak, (fh, fw) = peak_rss_delta(step(linear_cross_entropy))
    logits_bytes = tokens * vocab * 4  # 256 MiB
    torch.testing.assert_close(fh, ph, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fw, pw, rtol=1e-6, atol=1e-6)
    print(f"peak RSS rise: plain {plain_peak / 2**20:.0f} MiB, chunked {fused_peak / 2**20:.0f} MiB, "
          f"logits {logits_bytes / 2**20:.0f} MiB")
    assert plain_peak - fused_peak >= logits_bytes, (plain_peak, fused_peak)
    assert fused_peak < 0.5 * logits_bytes, fused_peak
