"""Context parallel: the load-balanced layout, exact attention, and model-level parity on 2 ranks.

Oracles: the chunk layout written out by hand; attention as a naive softmax(QKᵀ·scale + mask)·V over the
whole sequence in one process (with kv heads repeated by ``repeat_interleave``); the plain model (no plan)
on the whole sequence for the model-level comparison.
"""

from __future__ import annotations

import math

import pytest
import torch

from longspan.core.errors import ConfigError
from longspan.parallel.context_parallel import (
    _rank_major_to_sequence,
    _sequence_to_rank_major,
    load_balanced_indices,
    local_attention,
    slice_batch_for_context_parallel,
)

# ---------------------------------------------------------------------------------------------- oracles


def naive_attention(q, k, v, mask=None, scale=None):
    """softmax(q kᵀ · scale + mask) v over [b, h, s, d]; kv groups repeated; ``mask`` True = masked, None =
    causal."""
    n_rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(n_rep, dim=1)
    v = v.repeat_interleave(n_rep, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q @ k.transpose(-1, -2)) * scale
    s_q, s_k = q.shape[2], k.shape[2]
    if mask is None:
        mask = torch.ones(s_q, s_k, dtype=torch.bool).triu(1)
    scores = scores.masked_fill(mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def document_mask(seq: int, boundaries: list[int]) -> torch.Tensor:
    """[1, 1, s, s] bool, True = masked: causal and no attention across document boundaries."""
    doc = torch.zeros(seq, dtype=torch.long)
    for b in boundaries:
        doc[b:] += 1
    allowed = (doc[:, None] == doc[None, :]) & torch.ones(seq, seq, dtype=torch.bool).tril()
    return (~allowed)[None, None]


# ------------------------------------------------------------------------------------- layout (1 process)


def test_load_balanced_indices_are_megatrons_mirrored_chunks():
    # cp=2, S=8: chunks of 2; rank 0 keeps chunks 0 and 3, rank 1 chunks 1 and 2
    assert load_balanced_indices(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert load_balanced_indices(8, 2, 1).tolist() == [2, 3, 4, 5]
    # cp=4, S=16: rank r keeps chunks r and 7-r
    assert load_balanced_indices(16, 4, 1).tolist() == [2, 3, 12, 13]
    assert load_balanced_indices(16, 4, 3).tolist() == [6, 7, 8, 9]
    together = torch.cat([load_balanced_indices(24, 3, r) for r in range(3)])
    assert sorted(together.tolist()) == list(range(24))


def test_load_balanced_indices_reject_indivisible_length():
    with pytest.raises(ConfigError, match=r"sequence length 10 is not divisible by 2 x context_parallel_size \(4\)"):
        load_balanced_indices(10, 2, 0)


def test_rank_major_round_trip():
    full = torch.arange(24).view(1, 24)
    parts = _sequence_to_rank_major(full, 3, seq_dim=1)
    assert parts[0].tolist() == [[0, 1, 2, 3, 20, 21, 22, 23]]
    assert torch.equal(_rank_major_to_sequence(parts, seq_dim=1), full)


def test_slice_batch_keeps_global_positions_and_query_rows():
    tokens = torch.arange(16).view(2, 8)
    mask = document_mask(8, [3])
    batch = {"tokens": tokens, "labels": tokens + 100, "loss_mask": torch.ones(2, 8), "attention_mask": mask}
    out = slice_batch_for_context_parallel(batch, 2, 1)
    assert out["tokens"].tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert out["labels"].tolist() == [[102, 103, 104, 105], [110, 111, 112, 113]]
    assert out["position_ids"].tolist() == [[2, 3, 4, 5]]
    assert out["loss_mask"].shape == (2, 4)
    assert torch.equal(out["attention_mask"], mask[:, :, 2:6, :])
    assert batch["tokens"] is tokens  # the input batch is not modified


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("masked,cpu_flash", [(False, True), (False, False), (True, True)],
                         ids=["causal_cpu_flash", "causal_lower_right_sdpa", "document_mask"])
def test_local_attention_of_all_ranks_is_full_attention(cp, masked, cpu_flash, monkeypatch):
    """Every rank's local attention (given the gathered K/V) equals the full attention rows it holds, and the
    gradients summed over ranks equal the full attention's gradients (what the reduce-scatter computes).
    Causal attention has two paths: CPU flash blocks merged by log-sum-exp, and SDPA with a bottom-right
    causal bias (the CUDA path)."""
    import longspan.parallel.context_parallel as cp_module

    monkeypatch.setattr(cp_module, "USE_CPU_FLASH", cpu_flash)
    torch.manual_seed(0)
    b, heads, groups, seq, d = 2, 4, 2, 8 * cp, 8
    q = torch.randn(b, heads, seq, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, groups, seq, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, groups, seq, d, dtype=torch.float64, requires_grad=True)
    w = torch.randn(b, heads, seq, d, dtype=torch.float64)
    mask = document_mask(seq, [3, seq // 2 + 1]) if masked else None
    want = naive_attention(q, k, v, mask, scale=0.3)
    want_grads = torch.autograd.grad((want * w).sum(), (q, k, v))

    total = 0.0
    for rank in range(cp):
        idx = load_balanced_indices(seq, cp, rank)
        out = local_attention(q[:, :, idx], k, v, cp, rank, mask, 0.0, 0.3)
        torch.testing.assert_close(out, want[:, :, idx], rtol=1e-10, atol=1e-10)
        total = total + (out * w[:, :, idx]).sum()
    got_grads = torch.autograd.grad(total, (q, k, v))
    for got, ref in zip(got_grads, want_grads):
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)


# ------------------------------------------------------------------------------------------ 2 processes


def _attention_case(masked: bool) -> dict:
    """On each rank: CP attention of the local chunks vs the naive full attention, outputs and gradients."""
    import torch.distributed as dist

    from longspan.parallel.context_parallel import context_parallel_attention, gather_sequence
    from tests.parallel.harness import init_gloo

    init_gloo(timeout_s=60)
    cp, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)  # the same full tensors on every rank
    b, heads, groups, seq, d = 2, 4, 2, 16, 8
    q = torch.randn(b, heads, seq, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, groups, seq, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, groups, seq, d, dtype=torch.float64, requires_grad=True)
    w = torch.randn(b, heads, seq, d, dtype=torch.float64)
    mask = document_mask(seq, [5, 11]) if masked else None
    want = naive_attention(q, k, v, mask)
    want_grads = torch.autograd.grad((want * w).sum(), (q, k, v))

    idx = load_balanced_indices(seq, cp, rank)
    local = [t.detach()[:, :, idx].clone().requires_grad_(True) for t in (q, k, v)]
    local_mask = mask[:, :, idx] if masked else None
    out = context_parallel_attention(*local, local_mask, 0.0, None, dist.group.WORLD)
    (out * w[:, :, idx]).sum().backward()
    errors = {"out": (out - want[:, :, idx]).abs().max().item()}
    for name, t, ref in zip("qkv", local, want_grads):
        full_grad = gather_sequence(t.grad, dist.group.WORLD, seq_dim=2)  # gathering is tested here too
        errors[f"d{name}"] = (full_grad - ref).abs().max().item()
    return errors


@pytest.mark.slow
@pytest.mark.parametrize("masked", [False, True], ids=["causal", "document_mask"])
def test_two_rank_attention_matches_full_attention(pool2, masked):
    for rank, errors in enumerate(pool2.run(_attention_case, masked, timeout=120)):
        assert max(errors.values()) < 1e-12, f"rank {rank}: {errors}"


def _small_provider(position_embedding_type: str = "rope"):
    from longspan.recipes.tiny import tiny

    model = tiny().model
    model.num_layers = 2
    model.hidden_size = 64
    model.ffn_hidden_size = 128
    model.num_attention_heads = 4
    model.num_query_groups = 2
    model.seq_length = 32
    model.vocab_size = 255
    model.position_embedding_type = position_embedding_type
    model.finalize()
    return model


def _model_case(position_embedding_type: str, reset_documents: bool) -> dict:
    """Per-token losses and gradients of the CP2 model (full batch in, plan hooks) vs the plain model."""
    import torch.distributed as dist

    from longspan.models.gpt import build_gpt_model
    from longspan.models.init import init_weights
    from longspan.parallel.context_parallel import apply_context_parallel
    from tests.parallel.harness import init_gloo

    init_gloo(timeout_s=60)
    cp = dist.get_world_size()
    provider = _small_provider(position_embedding_type)
    torch.manual_seed(3)
    seq = provider.seq_length
    tokens = torch.randint(0, 255, (2, seq))
    labels = torch.randint(0, 255, (2, seq))
    loss_mask = (torch.rand(2, seq) > 0.3).float()
    position_ids = mask = None
    if reset_documents:  # reset position ids and a document mask, as the GPT dataset builds them
        mask = document_mask(seq, [7, 20])
        position_ids = torch.cat([torch.arange(7), torch.arange(13), torch.arange(12)]).unsqueeze(0)

    def run(model):
        per_token = model(tokens, position_ids=position_ids, attention_mask=mask, labels=labels)
        loss = (per_token * loss_mask).sum() / loss_mask.sum()
        loss.backward()
        return per_token.detach(), loss.detach(), {n: p.grad for n, p in model.named_parameters()}

    reference = init_weights(build_gpt_model(provider, materialize=False), seed=5)
    want_tokens, want_loss, want_grads = run(reference)

    model = build_gpt_model(provider, materialize=False)
    apply_context_parallel(model, dist.group.WORLD)
    apply_context_parallel(model, dist.group.WORLD)  # idempotent: hooks installed twice would slice twice
    init_weights(model, seed=5)
    got_tokens, got_loss, got_grads = run(model)
    errors = {"per_token": (got_tokens - want_tokens).abs().max().item(),
              "loss_rel": abs(got_loss.item() - want_loss.item()) / want_loss.item()}
    worst = 0.0
    for name, grad in got_grads.items():
        grad = grad.clone()
        dist.all_reduce(grad)  # what DDP over dp x cp does: the average over the cp ranks
        grad /= cp
        scale = want_grads[name].abs().max().item()
        worst = max(worst, (grad - want_grads[name]).abs().max().item() / max(scale, 1e-12))
    errors["grad_rel"] = worst
    errors["loss"] = got_loss.item()
    return errors


@pytest.mark.slow
@pytest.mark.parametrize(
    "pos,reset", [("rope", False), ("learned_absolute", True), ("rope", True)],
    ids=["rope_causal", "learned_documents", "rope_documents"],
)
def test_two_rank_model_matches_one_process(pool2, pos, reset):
    results = pool2.run(_model_case, pos, reset, timeout=180)
    for rank, errors in enumerate(results):
        assert errors["per_token"] < 1e-5, f"rank {rank}: {errors}"
        assert errors["loss_rel"] < 1e-5, f"rank {rank}: {errors}"
        assert errors["grad_rel"] < 1e-5, f"rank {rank}: {errors}"
    assert results[0]["loss"] == results[1]["loss"]  # every cp rank reports the whole sequence's loss


def _pipeline_stages_case() -> dict:
    """Two pipeline stages (embedding + layer 0 | layer 1 + output) with the CP plan on each, run back to back:
    local hidden states pass between them, the last stage returns the whole sequence's per-token loss."""
    import torch.distributed as dist

    from longspan.models.gpt import build_gpt_model
    from longspan.models.init import init_weights
    from longspan.parallel.context_parallel import apply_context_parallel
    from tests.parallel.harness import init_gloo

    init_gloo(timeout_s=60)
    provider = _small_provider()
    torch.manual_seed(3)
    tokens = torch.randint(0, 255, (2, provider.seq_length))
    labels = torch.randint(0, 255, (2, provider.seq_length))
    want = init_weights(build_gpt_model(provider, materialize=False), seed=5)(tokens, labels=labels)

    first = build_gpt_model(provider, post_process=False, layer_numbers=[0], materialize=False)
    last = build_gpt_model(provider, pre_process=False, layer_numbers=[1], materialize=False)
    for stage in (first, last):
        apply_context_parallel(stage, dist.group.WORLD)
        init_weights(stage, seed=5)
    hidden = first(tokens)
    got = last(hidden, labels=labels)  # positions from the full-length labels
    return {"hidden": tuple(hidden.shape), "error": (got - want).abs().max().item()}


def test_two_rank_pipeline_stages_keep_local_hidden_states(pool2):
    for rank, result in enumerate(pool2.run(_pipeline_stages_case, timeout=120)):
        assert result["hidden"] == (2, 16, 64), f"rank {rank}: {result}"  # seq 32 / cp 2, not gathered
        assert result["error"] < 1e-5, f"rank {rank}: {result}"
