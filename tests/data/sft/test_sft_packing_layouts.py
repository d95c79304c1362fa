"""Packed sequences in every parallel layout: the loss of each packed microbatch equals the sum of its documents'
losses computed one by one on one process (fp32, rel <= 1e-5), through the trainer's forward step and schedules.

- TP2: the dense document mask is untouched by tensor parallel.
- CP2: the context-parallel plan keeps this rank's query rows of the mask (documents cross the chunk split).
- PP2 (1F1B), PP2 x VP2 (interleaved: two middle stages) and PP4 (two middle ranks): every stage's forward step
  reads the microbatch, so the mask and the per-document positions reach the middle stages (the Megatron
  Bridge bug this guards against dropped them there). Documents are uneven, so boundaries fall inside every
  microbatch.
The gradients are checked too: packed training under each layout gives the one-process packed gradients.
"""

from __future__ import annotations

import pytest

from tests.data.sft.test_sft_packing import (
    _docs,
    packed_forward_step_state,
    packed_microbatches,
    per_document_loss_sums,
    tiny_provider,
)

MBS = 2
REL = 1e-5  # fp32 CPU layout parity


def _layout_cfg(tp=1, pp=1, vp=None, cp=1, num_layers=4):
    from longspan.recipes.tiny import tiny

    cfg = tiny()
    cfg.model = tiny_provider(num_layers=num_layers, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                              virtual_pipeline_model_parallel_size=vp, context_parallel_size=cp)
    cfg.dist.distributed_backend = "gloo"
    cfg.dist.distributed_timeout_minutes = 1
    cfg.train.micro_batch_size = MBS
    return cfg


def _grads(chunks):
    from longspan.parallel.pipeline import unwrap_chunk

    out = {}
    for chunk in chunks:
        for name, p in unwrap_chunk(chunk).named_parameters():
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            out[name] = g.detach().clone()
    return out


def _layout_case(tp, pp, vp, cp, num_layers=4):
    from functools import partial

    from longspan.models.gpt import build_gpt_model
    from longspan.parallel.init import initialize_distributed
    from longspan.training.step.forward_step import forward_step
    from longspan.training.step.schedules import forward_backward_no_pipelining, get_forward_backward_func

    cfg = _layout_cfg(tp, pp, vp, cp, num_layers)
    parallel = initialize_distributed(cfg.dist, cfg.model, device="cpu")
    if pp > 1:
        from longspan.parallel.pipeline import build_pipeline_chunks

        chunks = build_pipeline_chunks(cfg, parallel, cfg.rng.seed)
    else:
        from longspan.parallel.parallelize import parallelize_model
        from longspan.models.gpt import init_weights

        model = parallelize_model(build_gpt_model(cfg.model, materialize=False), cfg, parallel)
        init_weights(model, seed=cfg.rng.seed, device=parallel.device)
        chunks = [model]
    docs = _docs(48, seed=11)
    batches, members = packed_microbatches(docs, MBS)
    step = partial(forward_step, packed_forward_step_state())
    kwargs = dict(forward_step_func=step, data_iterator=iter(batches), model=chunks, num_microbatches=len(batches),
                  calculate_per_token_loss=True)
    if pp > 1:
        kwargs["parallel"] = parallel
    reports, tokens = get_forward_backward_func(pp)(**kwargs)
    # one process: each document alone, and the packed batches for the gradients
    reference_model = build_gpt_model(_layout_cfg(num_layers=num_layers).model, seed=cfg.rng.seed, device="cpu")
    reference = per_document_loss_sums(reference_model, docs, members)
    forward_backward_no_pipelining(forward_step_func=step, data_iterator=iter(batches), model=[reference_model],
                                   num_microbatches=len(batches), calculate_per_token_loss=True)
    ref_grads = {n: p.grad for n, p in reference_model.named_parameters()}
    worst = 0.0
    for name, grad in _grads(chunks).items():
        ref = ref_grads[name if name in ref_grads else "embedding.word_embeddings.weight"]
        # under CP, DDP over dp x cp averages the ranks' gradients (each cp x its share) to the exact one
        worst = max(worst, float((grad - ref).abs().max() / ref.abs().max().clamp(min=1e-12)))
    return {"reports": [{k: v.tolist() for k, v in r.items()} for r in reports], "tokens": int(tokens),
            "reference": reference, "grad_rel_err": worst, "boundaries": [len(m) for m in members]}


def _check(results):
    for res in results:
        assert len(res["reports"]) == len(res["reference"]) >= 2
        assert all(n >= 3 for n in res["boundaries"])  # several documents in every microbatch
        for report, (want_sum, want_count) in zip(res["reports"], res["reference"]):
            got_sum, got_count = report["lm loss"]
            assert got_count == want_count
            assert abs(got_sum - want_sum) <= REL * abs(want_sum), (got_sum, want_sum)
        assert res["tokens"] == sum(c for _, c in res["reference"])
        assert res["grad_rel_err"] < 1e-5, res["grad_rel_err"]


@pytest.mark.parametrize("name,tp,pp,vp,cp", [
    ("tp2", 2, 1, None, 1),
    ("cp2", 1, 1, None, 2),
    ("pp2", 1, 2, None, 1),
    ("pp2_vp2_middle_stages", 1, 2, 2, 1),
])
@pytest.mark.slow
def test_packed_losses_match_per_document_losses(pool2, name, tp, pp, vp, cp):
    _check(pool2.run(_layout_case, tp, pp, vp, cp, timeout=240))


@pytest.mark.slow
def test_packed_losses_pp4_middle_ranks(pool4):
    _check(pool4.run(_layout_case, 1, 4, None, 1, timeout=300))
