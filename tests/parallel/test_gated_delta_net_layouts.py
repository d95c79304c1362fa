"""Gated DeltaNet hybrids (``longspan.parallel.gated_delta_net``) under every layout train the same model as one
process.

One tiny model, shared: 4 layers (``linear_attention_freq=[1, 1, 0, 1]``: DeltaNet, DeltaNet, full attention,
DeltaNet; the pipeline cut falls between the two DeltaNet layers and the attention one), hidden 48, 2 key heads
of 8 channels and 6 value heads of 4 (uneven: 3 value heads per key head), a conv of 3, gated full attention
(``attention_output_gate``, 6 query heads in 2 groups, QK-norm). Its MoE variant (``linear_attention_freq=2``, 4
experts top 2 with a sigmoid-gated shared expert) runs under expert parallel and the other layouts.

- ``pretrain`` for 8 iterations under TP2+SP, PP2, DP2 with FSDP2, CP2 (the all-to-all to heads), and the
  MoE variant under EP2, TP2, PP2, DP2 with FSDP2 and CP2: every iteration's loss and gradient norm within 1e-5
  (relative) of one process's.
- Packed documents (``cu_seqlens``, three of uneven length, one crossing the chunks the cp ranks hold) under
  CP2 and TP2+SP, at model level: the loss and every parameter's gradient equal one process's; and under TP2+SP
  with DoRA on every projection (the DeltaNet's adapters split with its heads): every adapter's gradient.
- Head counts the layout cannot split are one-line ConfigErrors from the config's validation.
"""

from __future__ import annotations

import os

import pytest

from tests.helpers.layout_parity import logged, moe_variant_references
from tests.parallel.harness import get_shared_pool
from tests.training.pretrain_helpers import mock_layout_run

ITERS = 8
REL = 1e-5
SEQ = 64

#: the gated DeltaNet fields of the tiny model (GPTModelProvider's, Megatron's names)
DELTANET = dict(experimental_attention_variant="gated_delta_net", linear_conv_kernel_dim=3, linear_key_head_dim=8,
                linear_value_head_dim=4, linear_num_key_heads=2, linear_num_value_heads=6,
                attention_output_gate=True)


def _model_fields(m, moe: bool) -> None:
    m.num_layers, m.hidden_size, m.ffn_hidden_size = 4, 48, 96
    m.num_attention_heads, m.num_query_groups, m.kv_channels, m.qk_layernorm = 6, 2, 8, True
    for name, value in DELTANET.items():
        setattr(m, name, value)
    m.linear_attention_freq = 2 if moe else [1, 1, 0, 1]
    if moe:
        m.moe_ffn_hidden_size, m.moe_shared_expert_intermediate_size, m.moe_shared_expert_gate = 32, 32, True


def _config(run_dir: str, moe: bool = False, tp: int = 1, sp: bool = False, pp: int = 1, cp: int = 1,
            ep: int = 1, fsdp2: bool = False):
    from longspan.recipes import get_recipe

    cfg = get_recipe("tiny-moe" if moe else "tiny")
    m = cfg.model
    _model_fields(m, moe)
    m.tensor_model_parallel_size, m.sequence_parallel = tp, sp
    m.pipeline_model_parallel_size, m.context_parallel_size, m.expert_model_parallel_size = pp, cp, ep
    cfg.dist.use_torch_fsdp2 = fsdp2
    return mock_layout_run(cfg, f"{run_dir}/tb", SEQ, 2, 8, ITERS)


def _pretrain(run_dir: str, **layout) -> int:
    from longspan.training.pretrain import pretrain

    return pretrain(_config(run_dir, **layout)).train_state.step


LAYOUTS = {  # name: the config builder's keyword arguments (2 processes each)
    # plain TP (no sequence parallel) through the MoE variant's moe_tp2: the DeltaNet layers' plan is the same
    "tp2_sp": dict(tp=2, sp=True),
    "pp2": dict(pp=2),
    "dp2_fsdp2": dict(fsdp2=True),
    "cp2": dict(cp=2),
    "moe_ep2": dict(moe=True, ep=2),
    "moe_tp2": dict(moe=True, tp=2),
    "moe_pp2": dict(moe=True, pp=2),
    "moe_dp2_fsdp2": dict(moe=True, fsdp2=True),
    "moe_cp2": dict(moe=True, cp=2),
}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory):
    """The one-process run of the dense model or of its MoE variant, trained once each when first asked."""
    return moe_variant_references(tmp_path_factory, _pretrain, ITERS)


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_one_process(name: str, one_process, tmp_path) -> None:
    layout = LAYOUTS[name]
    want = one_process(layout.get("moe", False))
    assert want["losses"][-1] < want["losses"][0] * 0.95  # the reference trained
    get_shared_pool(2).run(_pretrain, str(tmp_path), timeout=200, **layout)
    got = logged(os.path.join(str(tmp_path), "tb"))
    assert got["iterations"] == want["iterations"] == list(range(1, ITERS + 1))
    for key in ("losses", "norms"):
        for i, (g, w) in enumerate(zip(got[key], want[key], strict=True)):
            assert abs(g - w) <= REL * abs(w), f"{name} {key}[{i}]: {g} vs one process {w}"


# ------------------------------------------------------------ packed documents, model level, 2 processes

DOCUMENTS = [13, 30, 21]  # 64 tokens; under cp2 the chunks are 16 tokens, so every document crosses one


def _packed_batch():
    import torch

    g = torch.Generator().manual_seed(3)
    tokens, labels = torch.randint(0, 250, (1, SEQ), generator=g), torch.randint(0, 250, (1, SEQ), generator=g)
    starts = torch.tensor([0] + DOCUMENTS).cumsum(0)
    positions = torch.cat([torch.arange(n) for n in DOCUMENTS])[None]
    doc = torch.repeat_interleave(torch.arange(len(DOCUMENTS)), torch.tensor(DOCUMENTS))
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    mask = ~(causal & (doc[:, None] == doc[None, :]))[None, None]  # True = masked
    return tokens, labels, positions, mask, starts[None]


def _dora():
    from longspan.peft import DoRA

    # B drawn non-zero, so every factor's gradient is non-trivial; every projection of both kinds of layer
    return DoRA(dim=4, alpha=1, lora_B_init_method="normal",
                target_modules=["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "in_proj", "out_proj"])


def _packed_case(layout: dict, peft: bool = False) -> dict:
    """The loss and every parameter's (full) gradient of one packed batch, on this process's layout (``peft``:
    with DoRA adapters, the gradients of the adapters)."""
    import torch
    from torch.distributed.tensor import DTensor

    from longspan.models.gpt import build_gpt_model
    from longspan.models.init import init_weights
    from longspan.parallel.init import initialize_distributed
    from longspan.parallel.parallelize import parallel_loss_context, parallelize_model
    from longspan.peft.adapters import init_adapters, init_dora_magnitudes

    cfg = _config("unused", **layout)
    parallel = initialize_distributed(cfg.dist, cfg.model, device="cpu") if layout else None
    cfg.model.vocab_size = 256
    cfg.model.finalize()
    model = build_gpt_model(cfg.model, materialize=False)
    if peft:
        _dora().apply(model)
    if parallel is not None:
        model = parallelize_model(model, cfg, parallel)
    init_weights(model, seed=5, device="cpu")
    if peft:
        init_adapters([model], 5)
        init_dora_magnitudes([model])
    tokens, labels, positions, mask, cu = _packed_batch()
    with parallel_loss_context(model):
        loss = model(tokens, position_ids=positions, attention_mask=mask, labels=labels, cu_seqlens=cu).mean()
        loss.backward()
    grads = {}
    for name, p in getattr(model, "module", model).named_parameters():
        if not p.requires_grad:
            continue
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        grads[name] = grad
    if parallel is not None and parallel.cp_size > 1:  # each cp rank holds cp x its share: average over cp
        import torch.distributed as dist

        for grad in grads.values():
            dist.all_reduce(grad, group=parallel.cp_group)
            grad /= parallel.cp_size
    inner = getattr(model, "module", model)
    mixer = inner.decoder.layers["0"].self_attention
    placements = {name: str(tuple(getattr(p, "placements", ()))) for name, p in mixer.named_parameters()}
    return {"loss": float(loss.detach()), "grads": grads, "placements": placements,
            "exchange": repr(mixer.context_parallel)}


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["cp2", "tp2_sp", "tp2_sp_dora"])
def test_packed_documents_under_layout_match_one_process(name: str) -> None:
    import torch

    peft = name.endswith("_dora")
    want = _packed_case({}, peft)
    for rank, got in enumerate(get_shared_pool(2).run(_packed_case, LAYOUTS[name.removesuffix("_dora")], peft,
                                                       timeout=100)):
        assert got["loss"] == pytest.approx(want["loss"], rel=REL), rank
        p = got["placements"]
        if name == "cp2":
            assert got["exchange"] == "GatedDeltaNetContextParallel(all-to-all over 2 ranks)"
        elif peft:  # the adapters split with their base weights (A whole / B by heads; linear_proj the other way)
            assert p["linear_q.adapter.linear_in.weight"] == p["linear_proj.adapter.linear_out.weight"] == \
                "(Replicate(),)", p
            assert p["linear_z.adapter.linear_out.weight"] == p["linear_a.adapter.weight_magnitude"] == \
                p["linear_proj.adapter.linear_in.weight"].replace("dim=1", "dim=0") == "(Shard(dim=0),)", p
            assert sum(".adapter." in k for k in want["grads"]) == len(want["grads"]) > 40
        else:  # the mixer is split by heads, its shared norm weight replicated
            assert p["linear_q.weight"] == p["conv_v.weight"] == p["A_log"] == "(Shard(dim=0),)", p
            assert p["linear_proj.weight"] == "(Shard(dim=1),)" and p["norm.weight"] == "(Replicate(),)", p
        assert sorted(got["grads"]) == sorted(want["grads"])
        for key, grad in got["grads"].items():
            torch.testing.assert_close(grad, want["grads"][key], rtol=1e-5, atol=1e-6, msg=f"{name} {key}")


# --------------------------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("layout, words", [
    (dict(tp=4), "model.linear_num_key_heads=2 is not divisible by tensor_model_parallel_size=4"),
    (dict(tp=2, cp=2), "model.tensor_model_parallel_size=2 × model.context_parallel_size=2 must divide "
                       "model.linear_num_key_heads=2"),
])
def test_heads_the_layout_cannot_split_are_one_line_errors(layout: dict, words: str, tmp_path) -> None:
    from longspan.core.errors import ConfigError

    cfg = _config(str(tmp_path), **layout)
    cfg.model.num_attention_heads, cfg.model.num_query_groups = 8, 4  # attention itself splits 4 ways
    with pytest.raises(ConfigError) as error:
        cfg.validate(world_size=4)
    assert words in str(error.value) and "\n" not in str(error.value)
