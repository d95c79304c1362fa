"""``longspan plan`` on DeepSeek-V3-shaped models: multi-latent attention (with and without query compression),
multi-token prediction, a dense first layer, routed + shared experts with the aux-loss-free expert bias.

Parameter counts equal the built model's, per rank too: tensor and expert parallel are applied for real to
the meta model in one process (a fake process group; local shard sizes), pipeline stages are built as the
pipeline builds them. Activation bytes equal a hand count of what each layer saves, and an MoE layer's
estimate (its dense stand-in plus routing) matches a real CPU forward measured with the same hook.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from longspan.models.gpt import build_gpt_model
from longspan.parallel.expert_parallel import apply_expert_parallel
from longspan.parallel.init import ParallelState
from longspan.parallel.mesh import build_device_mesh, derive_layout
from longspan.parallel.tensor_parallel import apply_tensor_parallel
from longspan.planner import plan as planner
from longspan.planner.activations import activation_parts, routing_bytes_per_token
from longspan.recipes import get_recipe

H, HEADS, Q_RANK, KV_RANK, QK, PE, V_HEAD = 128, 8, 64, 32, 16, 8, 16
DENSE_FFN, EXPERTS, TOPK, MOE_FFN, SHARED_FFN, VOCAB, SEQ = 512, 8, 2, 128, 128, 4096, 256


def _deepseek(q_lora_rank=Q_RANK, mtp_num_layers=1):
    """tiny-deepseek (the sizes above; layer 0 dense, layers 1-3 MoE), micro batch 1."""
    cfg = get_recipe("tiny-deepseek")
    cfg.model.vocab_size = VOCAB
    cfg.model.q_lora_rank = q_lora_rank
    cfg.model.mtp_num_layers = mtp_num_layers
    cfg.model.finalize()
    cfg.train.micro_batch_size = 1
    return cfg


# ------------------------------------------------------------------------------------------ parameters

@pytest.mark.parametrize("q_lora_rank,depths", [(Q_RANK, 1), (None, 1), (Q_RANK, None)])
def test_plan_parameter_count_is_the_built_models(q_lora_rank, depths):
    cfg = _deepseek(q_lora_rank, depths)
    meta = cfg.model.provide_meta()
    counts = planner.model_parameter_counts(cfg, meta)
    assert counts["total"] == sum(p.numel() for p in meta.parameters())
    moe_layers = 3 + (depths or 0)  # the MTP depth's layer is built like the last (MoE) layer
    routed = moe_layers * EXPERTS * 3 * H * MOE_FFN  # gate, up, down of every routed expert
    assert counts["active"] == counts["total"] - routed * (1 - TOPK / EXPERTS)
    assert planner.summary_line(cfg, meta).startswith(
        f"model: {counts['total']:,.0f} parameters ({counts['active']:,.0f} active per token); ")


def _fake_world(world_size: int):
    if dist.is_initialized():
        raise RuntimeError("a process group is already initialized in this test process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)


def _local_parameters(cfg, tp: int, ep: int) -> float:
    """Parameters rank 0 of 4 holds after the run's tensor- and expert-parallel plans (before data parallel)."""
    meshes = build_device_mesh(4, tp=tp, ep=ep, etp=tp)
    parallel = ParallelState(world_size=4, rank=0, local_rank=0, device=torch.device("cpu"), backend="fake",
                             layout=meshes.layout, meshes=meshes)
    model = build_gpt_model(cfg.model, materialize=False)
    if tp > 1:
        apply_tensor_parallel(model, parallel.submesh("tp"))
    apply_expert_parallel(model, parallel)
    return float(sum(getattr(p, "_local_tensor", p).numel() for p in model.parameters()))


@pytest.mark.parametrize("q_lora_rank", [Q_RANK, None])
def test_per_rank_counts_equal_the_tensor_and_expert_parallel_shards(q_lora_rank):
    """MLA's up-projections and output projection, the MTP eh_proj, shared experts, embedding and output layer
    split over tp; routed experts over ep x etp (etp = tp); norms, routers, down-projections whole."""
    cfg = _deepseek(q_lora_rank, 1)
    meta = build_gpt_model(cfg.model, materialize=False)
    _fake_world(4)
    try:
        for tp, ep in [(2, 1), (1, 2), (2, 2), (1, 4)]:
            layout = derive_layout(4, tp=tp, ep=ep, etp=tp)
            lcfg = copy.deepcopy(cfg)
            lcfg.model.tensor_model_parallel_size, lcfg.model.expert_model_parallel_size = tp, ep
            lcfg.model.expert_tensor_parallel_size = tp
            rank = planner.rank_parameter_counts(lcfg, layout, meta)[0]
            assert rank["dense"] + rank["expert"] == _local_parameters(lcfg, tp, ep), (tp, ep)
    finally:
        dist.destroy_process_group()


def test_pipeline_stages_hold_the_embedding_copy_mtp_needs():
    """pp=2: stage 0 the embedding and layers 0-1, stage 1 layers 2-3, the final norm, the output layer, the
    MTP depth and its own copy of the embedding (the depth embeds shifted token ids)."""
    cfg = _deepseek(Q_RANK, 1)
    meta = build_gpt_model(cfg.model, materialize=False)
    ranks = planner.rank_parameter_counts(cfg, derive_layout(2, pp=2), meta)
    first = build_gpt_model(cfg.model, pre_process=True, post_process=False, layer_numbers=[0, 1],
                            materialize=False)
    last = build_gpt_model(cfg.model, pre_process=False, post_process=True, layer_numbers=[2, 3],
                           materialize=False)
    assert last.embedding is not None and last.mtp is not None
    for rank, stage in zip(ranks, (first, last)):
        assert rank["dense"] + rank["expert"] == sum(p.numel() for p in stage.parameters())


# ------------------------------------------------------------------------------------------ activations

def _mla_saved_per_token(q_lora: bool) -> int:
    """float32 numbers one MLA block saves per token (input norm to output projection)."""
    saved = H + 1  # input_layernorm: its input and 1/rms
    saved += H  # the normed input (kv down-projection's and query down- or full projection's input)
    if q_lora:
        saved += Q_RANK + 1 + Q_RANK  # q_layernorm's input and 1/rms; the up-projection's input
    saved += KV_RANK + 1 + KV_RANK  # kv_layernorm's input and 1/rms; kv_up_proj's input
    saved += 2 * PE  # the rotary tables of this layer's rotations ([s, 1, pe] each)
    saved += 2 * HEADS * (QK + PE)  # flash attention's q and k
    saved += HEADS * (QK + V_HEAD)  # kv_up_proj's output, of which v is a view
    saved += HEADS * V_HEAD + HEADS  # flash attention's output and log-sum-exp
    saved += HEADS * V_HEAD  # linear_proj's input
    return saved


def _mlp_saved_per_token(ffn: int) -> int:
    """pre_mlp_layernorm (input, 1/rms), fc1's input, SwiGLU's gate, up and silu(gate), fc2's input."""
    return H + 1 + H + 4 * ffn


@pytest.mark.parametrize("q_lora", [True, False])
def test_mla_layer_and_mtp_activations_equal_the_hand_count(q_lora):
    tokens = SEQ  # one microbatch of one sequence
    parts = activation_parts(_deepseek(Q_RANK if q_lora else None, 1), derive_layout(1))
    attention = _mla_saved_per_token(q_lora)
    assert attention == (1371 if q_lora else 1242)
    routing = 3 * TOPK * H * 4 + EXPERTS * (4 + 2) + TOPK * (3 * 8 + 2 * 4)  # bytes per token
    assert routing_bytes_per_token(_deepseek().model) == routing
    assert parts["dense_layer"] == 4 * tokens * (attention + _mlp_saved_per_token(DENSE_FFN))
    moe_stand_in = 4 * tokens * (attention + _mlp_saved_per_token(TOPK * MOE_FFN + SHARED_FFN))
    assert parts["moe_layer"] == moe_stand_in + tokens * routing
    assert parts["layer"] == max(parts["dense_layer"], parts["moe_layer"])
    no_mtp = activation_parts(_deepseek(Q_RANK if q_lora else None, None), derive_layout(1))
    # one MTP depth: the shifted ids (int64); enorm and hnorm inputs and 1/rms; the [2h] concatenation
    # (eh_proj's input); one MoE layer; its final norm (input, 1/rms); its loss: the normed hidden states, the
    # float32 logits' gradient (formed in the forward), the valid-token mask (bool) and the float loss mask;
    # two scalars (the depth's token count and scaled loss)
    per_token = 4 * ((H + 1) + (H + 1) + 2 * H + (H + 1) + H + VOCAB + 1) + 8 + 1
    assert parts["output"] - no_mtp["output"] == tokens * per_token + parts["moe_layer"] + 2 * 4


def _real_moe_layer_bytes(cfg) -> float:
    """Saved bytes of one real MoE layer: a CPU forward of 2 MoE layers minus 1, with the planner's hook rule."""

    def saved(num_layers: int) -> float:
        provider = copy.deepcopy(cfg.model)
        provider.num_layers, provider.moe_layer_freq = num_layers, [1] * num_layers
        model = build_gpt_model(provider, seed=0)
        model.train()
        params = {id(p) for p in model.parameters()}
        seen: dict[int, float] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            base = t._base if t._base is not None else t
            if id(base) not in params and id(t) not in params:
                seen[id(base)] = float(base.numel() * base.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            tokens = torch.randint(0, cfg.model.vocab_size, (1, cfg.model.seq_length))
            model(tokens, labels=tokens)
        return sum(seen.values())

    return saved(2) - saved(1)


def test_moe_layer_estimate_matches_a_real_forward():
    """DeepSeek routing (sigmoid scores, expert groups, expert bias, shared expert, top-2 of 8) behind plain
    grouped-query attention, which the CPU runs as the same flash kernel the planner counts: the stand-in plus
    routing bytes are within 2% of a real forward's saved tensors (the router's small index tensors differ)."""
    cfg = _deepseek(Q_RANK, None)
    m = cfg.model
    m.multi_latent_attention, m.qk_layernorm, m.num_query_groups = False, False, 4
    m.seq_length, m.vocab_size, m.num_layers, m.moe_layer_freq = 64, 256, 2, [1, 1]
    m.finalize()
    estimate = activation_parts(cfg, derive_layout(1))["moe_layer"]
    measured = _real_moe_layer_bytes(cfg)
    assert estimate == pytest.approx(measured, rel=0.02), (estimate, measured)
    stand_in = estimate - m.seq_length * routing_bytes_per_token(m)
    assert measured - stand_in > 0.2 * measured  # what the dense stand-in alone would miss
