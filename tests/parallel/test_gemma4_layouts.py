"""Gemma 4 (``longspan.families.gemma4``) under every layout trains the same model as one process.

One tiny model, shared: 4 layers (sliding window of 8, full attention, sliding, full), the last two reusing the
keys and values of the first two (``num_kv_shared_layers=2``, double-wide MLPs), per-layer inputs of width 4,
full-attention layers with wider heads in 2 KV groups and keys as values, soft-capped logits. Its MoE variant
adds the MoE block (4 experts, top 2) beside every dense MLP.

- ``pretrain`` for 8 iterations under TP2, PP2, CP2, DP2 with FSDP2, and the MoE variant under EP2, TP2 and
  PP2: every iteration's loss and gradient norm within 1e-5 (relative) of one process's (measured: 3e-7 at
  most). PP2 cuts between the layers that make the shared keys and values and the layers that reuse them:
  the stages exchange them, and every layer's per-layer inputs, beside the hidden states.
- Pipeline parallel with KV sharing or per-layer inputs under context parallel (not proven yet; sequence
  parallel likewise), and a tp that splits a full-attention KV group: one-line errors from the config's
  validation.

The norms' epsilon is 1e-2, not Gemma 4's 1e-6: this tiny model's MLP outputs, per-layer projections and
attention outputs reach their RMSNorms with an RMS of about 3e-4, 2e-3 and 4e-2, which the norms scale up to 1
(a Jacobian of ~1/RMS). With epsilon 1e-6 that makes the gradients so sensitive to the weights that any change
of summation order (the layouts' partial sums, or one process with microbatches of 1 or 4 instead of 2) moves
the gradient norms of iterations 4-8 by 1e-5 to 2e-4 while the losses agree to 1e-7; with 1e-2 they agree to
3e-7. The gradients themselves agree: at equal weights (iterations 1-2) every
tensor's gradient under every layout is within fp32 rounding of one process's (TP2 5e-6, CP2 2e-6, EP2 3e-7,
FSDP2 1e-7 relative; one process's fp32 gradients against float64 differ by 9e-6), so no tensor misses or
doubles a reduction.
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


def _model(moe: bool):
    from longspan.families.gemma4.provider import Gemma4ModelProvider
    from longspan.models.activations import gelu_tanh

    experts = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16,
                   moe_router_load_balancing_type="none") if moe else {}
    return Gemma4ModelProvider(
        num_layers=4, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4, num_query_groups=2, kv_channels=8,
        global_kv_channels=16, num_global_query_groups=2, attention_k_eq_v=True, softmax_scale=1.0,
        vocab_size=256, seq_length=SEQ, normalization="RMSNorm", layernorm_epsilon=1e-2,  # see the docstring
        layernorm_after_sublayers=True, qk_layernorm=True, apply_embedding_scaling=True, gated_linear_unit=True,
        activation_func=gelu_tanh, add_bias_linear=False, position_embedding_type="rope",
        rotary_base=[10_000, 1_000_000], global_rotary_percent=0.25, rope_scaling_factor=1.0, window_size=[7, 0],
        window_attn_skip_freq=2, num_kv_shared_layers=2, use_double_wide_mlp=True, per_layer_embed_dim=4,
        final_logit_softcapping=30.0, share_embeddings_and_output_weights=True, attention_dropout=0.0,
        hidden_dropout=0.0, **experts)


def _config(run_dir: str, moe: bool = False, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1,
            fsdp2: bool = False):
    from longspan.recipes import get_recipe

    cfg = get_recipe("tiny")
    cfg.model = m = _model(moe)
    m.tensor_model_parallel_size, m.pipeline_model_parallel_size = tp, pp
    m.context_parallel_size, m.expert_model_parallel_size = cp, ep
    cfg.dist.use_torch_fsdp2 = fsdp2
    return mock_layout_run(cfg, f"{run_dir}/tb", SEQ, 2, 8, ITERS)


def _pretrain(run_dir: str, **layout) -> int:
    from longspan.training.pretrain import pretrain

    return pretrain(_config(run_dir, **layout)).train_state.step


LAYOUTS = {  # name: the config builder's keyword arguments (2 processes each)
    "tp2": dict(tp=2),
    "pp2": dict(pp=2),
    "cp2": dict(cp=2),
    "dp2_fsdp2": dict(fsdp2=True),
    "moe_ep2": dict(moe=True, ep=2),
    "moe_tp2": dict(moe=True, tp=2),
    "moe_pp2": dict(moe=True, pp=2),
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


def test_layouts_the_stages_cannot_carry_are_refused_by_validation(tmp_path) -> None:
    """Pipeline parallel with KV sharing under context parallel is refused in one line when the config is
    validated, not when a stage is built; so is a tp that splits a full-attention KV group."""
    from longspan.core.errors import ConfigError, NotSupportedError

    cfg = _config(str(tmp_path), pp=2, cp=2)
    with pytest.raises(NotSupportedError, match=r"pipeline_model_parallel_size=2 with model\.context_parallel_size=2 "
                       r"is not supported yet for Gemma 4 with num_kv_shared_layers=2") as error:
        cfg.validate(world_size=4)
    assert "\n" not in str(error.value)
    cfg = _config(str(tmp_path), tp=4)
    with pytest.raises(ConfigError, match=r"model\.num_global_query_groups=2 with tensor_model_parallel_size=4"):
        cfg.validate(world_size=4)
