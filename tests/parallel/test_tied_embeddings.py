"""Tied embeddings (``share_embeddings_and_output_weights``) under TP2, TP2+SP, CP2 and FSDP2.

A Qwen3-shaped tiny model (GQA, SwiGLU, RMSNorm, QK-norm, RoPE, tied embeddings; dropout off for parity)
is built as the trainer builds it (meta model -> ``parallelize_model`` -> ``init_weights``) under each layout
and compared with one process: its logits (max abs diff <= 1e-5), the gradient of the one tied weight (the
sum of the lookup's and the output projection's gradients, <= 1e-5), and 8 training iterations with the
trainer's loss maths (losses rel <= 1e-5). The one-process gradient is itself checked to be the sum of
an untied model's embedding and output-layer gradients. Under TP the output projection must use the very
word-embedding parameter, a vocab-sharded DTensor, and give vocab-sharded logits under the vocab-parallel
loss.

Every layout runs on the shared 2-rank pool (its workers start once per session: the expensive part).
"""

from __future__ import annotations

import pytest

from longspan.core.errors import NotSupportedError
from tests.parallel.harness import get_shared_pool

ITERS = 8
LOSS_REL_TOL = 1e-5
ABS_TOL = 1e-5

LAYOUTS = {  # name: tiny_config overrides
    # plain TP (no sequence parallel) with the chunked vocab-parallel loss; the logits path under TP2+SP
    "tp2_sp": dict(tp=2, sp=True),
    "tp2_fused_loss": dict(tp=2, cross_entropy_loss_fusion=True),
    "cp2": dict(context_parallel_size=2),
    "fsdp2": dict(fsdp2=True),
}


def tied_config(**overrides):
    """The shrunk ``tiny`` recipe made Qwen3-shaped and tied (see tests/parallel/test_layout_parity.py).

    The learning rate is 1e-3, not the recipe's 3e-3: on one repeated batch Adam at 3e-3 amplifies the
    layouts' float32 rounding (~1e-7) to ~1e-5 after 8 steps whether or not the weights are tied (measured
    for an untied TP2 model too); at 1e-3 the loss still falls by a quarter and layouts agree to ~2e-7.
    """
    from tests.parallel.test_layout_parity import tiny_config

    cfg = tiny_config(share_embeddings_and_output_weights=True, qk_layernorm=True, **overrides)
    cfg.optimizer.lr = 1e-3
    return cfg


def _inputs():
    import torch

    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, 4000, (2, 64), generator=g)
    labels = torch.randint(0, 4000, (2, 64), generator=g)
    return tokens, labels


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _plain(model):
    return model.module if hasattr(model, "module") and not hasattr(model, "decoder") else model


def run_layout(cfg) -> dict:
    """Logits, the tied weight's gradient and ``ITERS`` training losses of ``cfg`` on this process's layout.

    Every data-parallel rank gets the same tokens for the logits and gradient, so the averaged gradient is
    the one-process gradient of that batch.
    """
    import torch

    from longspan.parallel.parallelize import parallel_loss_context
    from tests.parallel.layout_training import build_layout_model, train_on_global_batches
    from tests.parallel.test_layout_parity import GBS, MBS, global_batches

    parallel, model, optimizer = build_layout_model(cfg)
    plain = _plain(model)
    weight = plain.embedding.word_embeddings.weight
    out: dict = {
        "params": sorted(name for name, _ in plain.named_parameters()),
        "placements": [repr(p) for p in getattr(weight, "placements", ())],
    }
    seen = {}

    def capture(module, args, output):
        seen["weight_is_embedding"] = args[1] is plain.embedding.word_embeddings.weight
        seen["logits"] = output

    handle = plain.tied_output.register_forward_hook(capture)
    tokens, labels = _inputs()
    model.eval()
    with torch.no_grad(), parallel_loss_context(model):
        out["logits"] = _full(model(tokens)).clone()
    model.train()
    optimizer.zero_grad()
    seen.pop("logits")
    with parallel_loss_context(model):
        model(tokens, labels=labels).mean().backward()
        logits = seen.get("logits")  # None: the fused loss never forms logits
        out["logits_in_loss"] = (type(logits).__name__, [repr(p) for p in getattr(logits, "placements", ())])
    handle.remove()
    out["weight_is_embedding"] = seen["weight_is_embedding"]
    out["grad"] = _full(weight.grad).clone()
    out["grads"] = {name: _full(p.grad).clone() for name, p in plain.named_parameters()}
    batches = global_batches(ITERS, seq=cfg.model.seq_length)
    out["losses"], out["norms"] = train_on_global_batches(model, optimizer, parallel, batches, GBS, MBS)
    return out


def _run_layout_task(name: str) -> dict:
    """Worker task: ``run_layout`` for the layout ``name`` of ``LAYOUTS``."""
    return run_layout(tied_config(**LAYOUTS[name]))


@pytest.fixture(scope="module")
def one_process() -> dict:
    return run_layout(tied_config())


def _max_rel(got: list[float], want: list[float]) -> float:
    return max(abs(g - w) / abs(w) for g, w in zip(got, want))


# ------------------------------------------------------------------------------------------ no processes

def test_tied_model_has_one_weight_and_a_parameter_free_projection():
    from longspan.models.gpt import build_gpt_model

    cfg = tied_config()
    cfg.model.finalize()
    model = build_gpt_model(cfg.model, materialize=False)
    assert model.output_layer is None and model.tied_output is not None
    assert list(model.tied_output.parameters()) == []
    assert "output_layer.weight" not in model.state_dict()


def test_plan_feeds_the_tied_projection_replicated_hidden_states_and_sums_qk_norm_grads():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, SequenceParallel

    from longspan.models.gpt import build_gpt_model
    from longspan.parallel.tensor_parallel import check_tensor_parallel, tensor_parallel_plan

    cfg = tied_config()
    cfg.model.finalize()
    model = build_gpt_model(cfg.model, materialize=False)
    check_tensor_parallel(model, 2)  # tied embeddings are no longer rejected
    for sp in (False, True):
        plan = tensor_parallel_plan(model, sequence_parallel=sp)
        assert "output_layer" not in plan
        qk_norm = plan["decoder.layers.0.self_attention.q_layernorm"]
        assert type(qk_norm) is SequenceParallel and qk_norm.sequence_sharding == (Shard(2),)
        tied = plan["tied_output"]
        assert type(tied) is PrepareModuleInput and tied.use_local_output is False
        assert tied.input_layouts == ((Shard(1) if sp else Replicate()), None)
        assert tied.desired_input_layouts == (Replicate(), None)


def test_t5_with_tied_embeddings_is_still_rejected_under_tp_in_one_line():
    from longspan.models.t5 import T5Model
    from longspan.models.t5_provider import T5ModelProvider
    from longspan.parallel.tensor_parallel import check_tensor_parallel

    import torch

    provider = T5ModelProvider(num_layers=2, encoder_num_layers=2, hidden_size=32, ffn_hidden_size=64,
                               num_attention_heads=4, kv_channels=8, vocab_size=256, seq_length=16)
    provider.finalize()
    with torch.device("meta"):
        model = T5Model(provider)
    with pytest.raises(NotSupportedError, match="T5ModelProvider") as info:
        check_tensor_parallel(model, 2)
    assert "\n" not in str(info.value)


def test_one_process_gradient_is_the_sum_of_both_uses(one_process):
    """The reference itself: the tied weight's gradient equals the embedding's plus the output layer's of an
    untied model holding the same weights."""
    import torch

    from longspan.models.gpt import build_gpt_model, init_weights

    tied_cfg, untied_cfg = tied_config(), tied_config()
    untied_cfg.model.share_embeddings_and_output_weights = False
    tied_cfg.model.finalize(), untied_cfg.model.finalize()
    tied = build_gpt_model(tied_cfg.model, materialize=False)
    init_weights(tied, seed=tied_cfg.rng.seed, device="cpu")
    untied = build_gpt_model(untied_cfg.model, materialize=False)
    init_weights(untied, seed=untied_cfg.rng.seed, device="cpu")
    state = dict(tied.state_dict())
    state["output_layer.weight"] = state["embedding.word_embeddings.weight"].clone()
    untied.load_state_dict(state)
    tokens, labels = _inputs()
    tied(tokens, labels=labels).mean().backward()
    untied(tokens, labels=labels).mean().backward()
    lookup = untied.embedding.word_embeddings.weight.grad
    projection = untied.output_layer.weight.grad
    assert lookup.abs().max() > 0 and projection.abs().max() > 0
    torch.testing.assert_close(tied.embedding.word_embeddings.weight.grad, lookup + projection,
                               atol=1e-7, rtol=1e-5)
    torch.testing.assert_close(one_process["grad"], lookup + projection, atol=1e-7, rtol=1e-5)


# ------------------------------------------------------------------------------------------ on 2 gloo ranks

@pytest.mark.parametrize("name", list(LAYOUTS))
def test_tied_layout_matches_one_process(name, one_process):
    """Logits, the tied gradient and 8 training losses of the layout equal one process's; the output
    projection uses the embedding parameter itself (no copy, no ``output_layer``); under TP that parameter is
    vocab-sharded and so are the logits the loss sees."""
    want = one_process["losses"]
    assert want[-1] < want[0] * 0.8  # the model trains: a layout training another model would show
    results = get_shared_pool(2).run(_run_layout_task, name, timeout=300)
    for rank, got in enumerate(results):
        where = f"{name} rank {rank}"
        logits_diff = float((got["logits"] - one_process["logits"]).abs().max())
        grad_diff = float((got["grad"] - one_process["grad"]).abs().max())
        # every other gradient too (QK-norm weights see only local heads under TP: summed over tp by the plan)
        worst = max(got["grads"], key=lambda n: float((got["grads"][n] - one_process["grads"][n]).abs().max()))
        worst_diff = float((got["grads"][worst] - one_process["grads"][worst]).abs().max())
        assert worst_diff <= ABS_TOL, f"{where}: gradient of {worst} differs by {worst_diff:.1e}"
        loss_rel = _max_rel(got["losses"], want)
        measured = f"{where}: logits {logits_diff:.1e}, tied grad {grad_diff:.1e}, losses rel {loss_rel:.1e}"
        assert logits_diff <= ABS_TOL and grad_diff <= ABS_TOL and loss_rel <= LOSS_REL_TOL, measured
        assert got["params"] == one_process["params"] and "output_layer.weight" not in got["params"], where
        assert got["weight_is_embedding"], where
        if name.startswith("tp2"):
            assert got["placements"] == ["Shard(dim=0)"], (where, got["placements"])
            if name != "tp2_fused_loss":  # the fused loss forms no logits at all
                assert got["logits_in_loss"] == ("DTensor", ["Shard(dim=2)"]), (where, got["logits_in_loss"])


@pytest.mark.slow  # four processes: ~45 s here, most of it starting them
def test_tied_pipeline_copy_under_tp2_pp2_sums_gradients():
    """PP keeps its synced copy of the tied weight on the last stage; under TP both the embedding's and the
    copy's gradients are vocab-sharded alike before the embedding group sums them (the lookup's comes back
    replicated), so every stage's gradients equal one process's."""
    from tests.parallel.test_pipeline import _check, _pipeline_case

    results = get_shared_pool(4).run(_pipeline_case, 2, None, 2, 2, "1f1b", False, True, timeout=300)
    _check(results)
    assert [r["stages"] for r in results] == [[0], [0], [1], [1]]
    assert all("output_layer.weight" in r["names"] for r in results[2:])  # the copy, checked against the tied grad
