"""Layout-independent initialization: determinism, per-name streams, Megatron's stds, wrappers, DTensors."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from tests.models.gpt_test_config import llama_config, make_config
from tests.parallel.harness import get_shared_pool, init_gloo

from longspan.models.gpt import build_gpt_model
from longspan.models.init import canonical_parameter_name, init_weights


def _state(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_same_seed_same_weights_different_seed_different():
    cfg = llama_config()
    a, b, c = (_state(build_gpt_model(cfg, seed=s)) for s in (5, 5, 6))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not torch.equal(a["decoder.layers.0.self_attention.linear_q.weight"],
                           c["decoder.layers.0.self_attention.linear_q.weight"])


def test_init_ignores_global_rng_and_construction_order():
    cfg = llama_config()
    torch.manual_seed(0)
    a = _state(build_gpt_model(cfg, seed=5))
    torch.manual_seed(123)
    torch.randn(1000)
    b = _state(build_gpt_model(cfg, seed=5))
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_different_names_draw_different_streams():
    cfg = llama_config(num_attention_heads=4, num_query_groups=4)  # k and v: same shape and std
    w = _state(build_gpt_model(cfg, seed=1))
    k0 = w["decoder.layers.0.self_attention.linear_k.weight"]
    assert not torch.equal(k0, w["decoder.layers.0.self_attention.linear_v.weight"])
    assert not torch.equal(k0, w["decoder.layers.1.self_attention.linear_k.weight"])
    assert not torch.equal(w["decoder.layers.0.mlp.linear_fc1.weight"], w["decoder.layers.0.mlp.linear_fc1_gate.weight"])


def test_megatron_init_distribution():
    std, L = 0.02, 4
    cfg = make_config(num_layers=L, hidden_size=256, ffn_hidden_size=1024, num_attention_heads=4, vocab_size=1000,
                      seq_length=64, init_method_std=std, share_embeddings_and_output_weights=False, add_bias_linear=True)
    w = _state(build_gpt_model(cfg, seed=0))
    scaled = std / math.sqrt(2 * L)
    for name, expected in (
        ("decoder.layers.1.mlp.linear_fc1.weight", std),
        ("decoder.layers.1.self_attention.linear_q.weight", std),
        ("embedding.word_embeddings.weight", std),
        ("embedding.position_embeddings.weight", std),
        ("output_layer.weight", std),
        ("decoder.layers.1.mlp.linear_fc2.weight", scaled),
        ("decoder.layers.1.self_attention.linear_proj.weight", scaled),
    ):
        t = w[name]
        assert abs(t.std().item() - expected) < 0.03 * expected, name
        assert abs(t.mean().item()) < 0.05 * expected, name
    for name, t in w.items():
        if "layernorm" in name and name.endswith("weight"):
            assert torch.equal(t, torch.ones_like(t)), name
        elif name.endswith("bias"):
            assert torch.equal(t, torch.zeros_like(t)), name


def test_embedding_init_method_std_is_honoured():
    cfg = make_config(hidden_size=128, vocab_size=4000, init_method_std=0.02)
    assert hasattr(cfg, "embedding_init_method_std")
    cfg.embedding_init_method_std = 0.1
    w = build_gpt_model(cfg, seed=0).embedding.word_embeddings.weight
    assert abs(w.std().item() - 0.1) < 0.003


def test_canonical_parameter_name_strips_wrappers():
    assert canonical_parameter_name(
        "module._orig_mod.decoder.layers.0._checkpoint_wrapped_module.mlp._fsdp_wrapped_module.linear_fc1.weight"
    ) == "decoder.layers.0.mlp.linear_fc1.weight"
    assert canonical_parameter_name("decoder.layers.0.mlp.weight") == "decoder.layers.0.mlp.weight"


class _DDPLike(nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module = module


def test_wrapped_models_get_the_same_weights():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    cfg = llama_config()
    reference = _state(build_gpt_model(cfg, seed=9))
    inner = build_gpt_model(cfg, materialize=False)
    for key in list(inner.decoder.layers.keys()):
        inner.decoder.layers[key] = checkpoint_wrapper(inner.decoder.layers[key])
    wrapped = _DDPLike(inner)
    init_weights(wrapped, seed=9)
    names = dict(wrapped.named_parameters())
    assert any("_checkpoint_wrapped_module" in n for n in names)
    for name, p in names.items():
        assert torch.equal(p, reference[canonical_parameter_name(name)]), name


def test_partial_stage_gets_the_full_models_weights():
    cfg = llama_config(num_layers=4)
    full = _state(build_gpt_model(cfg, seed=4))
    stage = build_gpt_model(cfg, seed=4, pre_process=False, layer_numbers=[2, 3])
    for name, p in stage.named_parameters():
        assert torch.equal(p, full[name]), name


def test_reinit_of_materialized_model_is_in_place():
    model = build_gpt_model(llama_config(), seed=1)
    before = [id(p) for p in model.parameters()]
    init_weights(model, seed=2)
    assert [id(p) for p in model.parameters()] == before
    expected = _state(build_gpt_model(llama_config(), seed=2))
    assert all(torch.equal(p, expected[n]) for n, p in model.named_parameters())


def test_perform_initialization_false_materializes_without_drawing():
    cfg = llama_config(perform_initialization=False)
    model = build_gpt_model(cfg)
    assert not any(p.is_meta for p in model.parameters())


# ---- DTensor layouts on a 2-rank gloo mesh ---------------------------------------------------------------------


def _sharded_task() -> dict:
    """On each of 2 ranks (the shared worker pool): TP- and FSDP2-sharded meta models initialized in place."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    init_gloo()  # the pool tears the process group down after the task
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    cfg = llama_config(num_layers=2, attention_dropout=0.0, hidden_dropout=0.0)
    # Tensor parallel: plain column/row-wise plans over the model's module names.
    tp = build_gpt_model(cfg, materialize=False)
    plan = {
        "embedding.word_embeddings": RowwiseParallel(input_layouts=Replicate()),
        "output_layer": ColwiseParallel(output_layouts=Replicate()),
    }
    for i in tp.decoder.layers.keys():
        for name in ("linear_q", "linear_k", "linear_v"):
            plan[f"decoder.layers.{i}.self_attention.{name}"] = ColwiseParallel()
        plan[f"decoder.layers.{i}.self_attention.linear_proj"] = RowwiseParallel()
        plan[f"decoder.layers.{i}.mlp.linear_fc1"] = ColwiseParallel()
        plan[f"decoder.layers.{i}.mlp.linear_fc1_gate"] = ColwiseParallel()
        plan[f"decoder.layers.{i}.mlp.linear_fc2"] = RowwiseParallel()
    parallelize_module(tp, mesh, plan)
    init_weights(tp, seed=77)
    q = tp.decoder.layers["0"].self_attention.linear_q.weight
    assert isinstance(q, DTensor) and q.placements == (Shard(0),)
    tokens = torch.arange(24).view(2, 12) % cfg.vocab_size
    with torch.no_grad():
        tp_logits = tp.eval()(tokens)
    tp_full = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach() for n, p in tp.named_parameters()}
    local_numel = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in tp.parameters())

    # FSDP2: per-layer and root fully_shard on the meta model, then init.
    fsdp = build_gpt_model(cfg, materialize=False)
    for layer in fsdp.decoder.layers.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(fsdp, mesh=mesh)
    init_weights(fsdp, seed=77)
    fsdp_full = {n: p.full_tensor().detach() for n, p in fsdp.named_parameters()}
    return {"tp": tp_full, "tp_logits": tp_logits, "fsdp": fsdp_full, "local_numel": local_numel}


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_sharded_dtensor_init_matches_unsharded():
    result = get_shared_pool(2).run(_sharded_task, timeout=120)[0]
    cfg = llama_config(num_layers=2, attention_dropout=0.0, hidden_dropout=0.0)
    reference_model = build_gpt_model(cfg, seed=77).eval()
    reference = _state(reference_model)
    for layout in ("tp", "fsdp"):
        assert result[layout].keys() == reference.keys()
        for name, t in reference.items():
            assert torch.equal(result[layout][name], t), f"{layout}: {name}"
    # The model runs unchanged with column-sharded q/k/v (local heads read from shapes).
    tokens = torch.arange(24).view(2, 12) % cfg.vocab_size
    with torch.no_grad():
        torch.testing.assert_close(result["tp_logits"], reference_model(tokens), atol=1e-5, rtol=1e-5)
    assert result["local_numel"] < sum(t.numel() for t in reference.values())
