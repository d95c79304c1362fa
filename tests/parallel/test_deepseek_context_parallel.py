"""DeepSeek-style models under context and sequence parallel: ``pretrain`` logs one process's losses.

A tiny DeepSeek-style model (multi-latent attention with query compression, a dense first layer, then MoE layers
with group-limited sigmoid routing, a shared expert, the aux-loss-free expert bias and the load-balancing and
z losses on, and two multi-token-prediction depths) trains 8 iterations on mock data with an uneven loss mask
(a fixed pattern of masked tokens on top of the masked EOD tokens; documents reset the attention and positions):

- under CP2 (the MTP shift crosses chunk boundaries), CP2 × EP2 (4 ranks: the expert-parallel pairs are the
  context-parallel pairs, the expert gradients summed over the data-parallel pairs) and CP2 × TP2 + SP (4 ranks:
  the depths and the MoE layers on sequence shards), the logged lm loss, ``mtp_k loss``,
  load-balancing loss, z-loss and load imbalance equal one process's per iteration (relative 1e-5), and after
  training every rank's expert biases equal one process's bit for bit: a bias moves by ±rate from the signs of
  integer token counts, summed exactly in float32 over the data × context ranks, so equal routing gives equal
  biases;
- a Mixtral/Qwen3-MoE-style router (softmax top-2 over all experts, aux loss and z-loss, no bias) under CP2
  likewise.

Each one-process reference runs once per module (``reference``); every run shares one cache of the mock data's
indices.
"""

from __future__ import annotations

import math

import pytest

from tests.parallel.harness import get_shared_pool
from tests.training.pretrain_helpers import mock_layout_run

pytestmark = pytest.mark.slow

ITERS = 8
REL_TOL = 1e-5
SEQ = 32
LOGGED = ("lm loss", "mtp_1 loss", "mtp_2 loss", "load_balancing_loss", "z_loss", "load_imbalance")
MIXTRAL_LOGGED = ("lm loss", "load_balancing_loss", "z_loss", "load_imbalance")

#: the model the last ``_pretrain`` of this process trained (recorded by the forward step)
_TRAINED: dict = {}


def _config(run_dir: str, cache_dir: str, cp: int = 1, ep: int = 1, tp: int = 1, sp: bool = False,
            router: str = "deepseek"):
    """``tiny-deepseek`` shrunk to seconds: 3 layers (dense, MoE, MoE) of hidden 32, 8 routed experts in 4
    groups (top-2 within the best 2 groups) + 1 shared, 2 MTP depths, 32-token sequences, 4 per step, no
    dropout. ``router='mixtral'``: softmax top-2 over all experts, no groups, bias, shared expert nor MTP."""
    from longspan.recipes import get_recipe

    cfg = get_recipe("tiny-deepseek")
    m = cfg.model
    m.num_layers, m.moe_layer_freq = 3, [0, 1, 1]
    m.hidden_size, m.ffn_hidden_size, m.moe_ffn_hidden_size, m.moe_shared_expert_intermediate_size = 32, 64, 16, 16
    m.num_attention_heads, m.seq_length, m.vocab_size = 4, SEQ, None
    m.q_lora_rank, m.kv_lora_rank, m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim = 16, 12, 8, 4, 8
    m.num_moe_experts, m.moe_router_num_groups, m.moe_router_group_topk = 8, 4, 2
    m.moe_router_load_balancing_type, m.moe_aux_loss_coeff, m.moe_z_loss_coeff = "aux_loss", 1e-2, 1e-3
    m.moe_router_bias_update_rate = 1e-2  # large enough to change the routing within a few steps
    m.mtp_num_layers, m.mtp_loss_scaling_factor = 2, 0.5
    if router == "mixtral":
        m.moe_router_score_function, m.moe_router_enable_expert_bias = "softmax", False
        m.moe_router_num_groups = m.moe_router_group_topk = m.moe_router_topk_scaling_factor = None
        m.moe_shared_expert_intermediate_size = m.mtp_num_layers = None
    m.hidden_dropout = m.attention_dropout = 0.0
    m.context_parallel_size, m.expert_model_parallel_size = cp, ep
    m.tensor_model_parallel_size, m.sequence_parallel = tp, sp
    mock_layout_run(cfg, run_dir, SEQ, 2, 4, ITERS)
    d = cfg.dataset
    d.path_to_cache = cache_dir
    d.eod_mask_loss = d.reset_attention_mask = d.reset_position_ids = True
    return cfg


class _UnevenMask:
    """The microbatches of ``batches`` with a fixed pattern of extra masked tokens (a function of the token id
    and position only, so every layout masks the same ones)."""

    def __init__(self, batches) -> None:
        self.batches = batches

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        import torch

        batch = dict(next(self.batches))
        tokens = batch["tokens"]
        positions = torch.arange(tokens.shape[1]).expand_as(tokens)
        keep = ((tokens + positions * positions) % 7 != 3).to(batch["loss_mask"].dtype)
        batch["loss_mask"] = batch["loss_mask"] * keep
        return batch


def _forward_step(state, data_iterator, model, *args, **kwargs):
    from longspan.training.step.forward_step import forward_step

    _TRAINED["model"] = model
    return forward_step(state, _UnevenMask(data_iterator), model, *args, **kwargs)


def _pretrain(run_dir: str, cache_dir: str, **layout) -> dict:
    """Worker task: ``pretrain``; this rank's logged rows (none on ranks that do not log) and expert biases."""
    import json
    import os

    from longspan.models.moe import moe_layers
    from longspan.training.pretrain import pretrain

    pretrain(_config(run_dir, cache_dir, **layout), _forward_step)
    metrics = os.path.join(run_dir, "metrics.jsonl")
    rows = [json.loads(line) for line in open(metrics)] if os.path.exists(metrics) else []
    model = _TRAINED.pop("model")
    biases = [layer.router.expert_bias.clone() for layer in moe_layers(model) if layer.router.expert_bias is not None]
    mtp = getattr(getattr(model, "module", model), "mtp", None)
    enorm = None if mtp is None else mtp.layers[0].enorm.weight  # a tp DTensor only under the sequence-parallel plan
    return {"rows": [r for r in rows if r.get("phase") == "train"], "biases": biases,
            "enorm": str(getattr(enorm, "placements", None))}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("index_cache"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache_dir):
    """One-process runs, each once per module, by router."""
    runs: dict = {}

    def run(router: str = "deepseek") -> dict:
        if router not in runs:
            runs[router] = _pretrain(str(tmp_path_factory.mktemp("one")), cache_dir, router=router)
        return runs[router]

    return run


def _assert_matches(got: dict, want: dict, names: tuple, what: str) -> None:
    assert [r["iteration"] for r in want["rows"]] == list(range(1, ITERS + 1))
    assert [r["iteration"] for r in got["rows"]] == list(range(1, ITERS + 1)), what
    for name in names:
        ref = [r["losses"][name] for r in want["rows"]]
        values = [r["losses"][name] for r in got["rows"]]
        worst = max(abs(g - w) / abs(w) for g, w in zip(values, ref))
        print(f"{what} {name}: max rel {worst:.1e} over {ITERS} iterations")  # with -rP
        assert all(math.isclose(g, w, rel_tol=REL_TOL) for g, w in zip(values, ref)), (what, name, values, ref)
    assert want["rows"][-1]["losses"]["lm loss"] < want["rows"][0]["losses"]["lm loss"]


def _run(tmp_path, cache_dir: str, ranks: int, **layout) -> list[dict]:
    results = get_shared_pool(ranks).run(_pretrain, str(tmp_path), cache_dir, timeout=300, **layout)
    assert any(r["rows"] for r in results)
    return results


LAYOUTS = {
    "cp2": (2, dict(cp=2)),
    "cp2_ep2": (4, dict(cp=2, ep=2)),
    # TP2 + SP on its own adds nothing that CP2 × TP2 + SP does not prove
    "cp2_tp2_sp": (4, dict(cp=2, tp=2, sp=True)),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_deepseek_moe_and_mtp_under_context_and_sequence_parallel_match_one_process(name, reference, cache_dir,
                                                                                    tmp_path):
    import torch

    want = reference()
    ranks, layout = LAYOUTS[name]
    results = _run(tmp_path, cache_dir, ranks, **layout)
    for got in results:
        if got["rows"]:
            _assert_matches(got, want, LOGGED, name)
    # the decoder's and the MTP depths' MoE layers; each bias moved
    assert len(want["biases"]) == 4 and all(float(b.abs().max()) > 0 for b in want["biases"])
    for rank, got in enumerate(results):
        for g, w in zip(got["biases"], want["biases"], strict=True):
            assert torch.equal(g, w), (name, rank, g, w)
    if name == "cp2_tp2_sp":  # the depths' norms ran on sequence shards: replicated over tp (FSDP2 shards dp × cp)
        assert all(r["enorm"] == "(Shard(dim=0), Replicate())" for r in results), [r["enorm"] for r in results]


def test_mixtral_style_moe_under_context_parallel_matches_one_process(reference, cache_dir, tmp_path):
    want = reference("mixtral")
    for got in _run(tmp_path, cache_dir, 2, cp=2, router="mixtral"):
        if got["rows"]:
            _assert_matches(got, want, MIXTRAL_LOGGED, "mixtral cp2")
