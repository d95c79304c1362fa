"""DeepSeek-V3 with mixture-of-experts layers (``first_k_dense_replace`` < ``num_hidden_layers``): multi-latent
attention with and without query compression, a dense first layer, then sigmoid routing over two expert groups
with random non-zero routing biases (``e_score_correction_bias``, large enough that ignoring them routes
differently) and a shared expert. Logits equal transformers' (fp32 <= 1e-5), import -> export is bit-identical,
and greedy generation equals transformers' token for token (multi-token-prediction layers:
test_mtp_conversion)."""

from __future__ import annotations

import pytest
import torch
import transformers

from longspan import AutoBridge
from longspan.conversion import families
from tests.conversion.parity import (
    assert_export_round_trips,
    greedy_hf,
    greedy_ours,
    hf_logits,
    load_hf,
    ours_logits,
    prompt_ids,
    read_config,
)

VOCAB, LAYERS, HEADS, HIDDEN = 96, 3, 4, 64
MOE_SHAPE = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=LAYERS,
                 num_attention_heads=HEADS, num_key_value_heads=HEADS, kv_lora_rank=16, qk_nope_head_dim=12,
                 qk_rope_head_dim=8, v_head_dim=10, first_k_dense_replace=1, n_routed_experts=8,
                 num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1, moe_intermediate_size=16,
                 routed_scaling_factor=2.5, norm_topk_prob=True, num_nextn_predict_layers=0,
                 max_position_embeddings=128, initializer_range=0.15, tie_word_embeddings=False,
                 attention_dropout=0.0, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
CASES = {"q_lora": 24, "no_q_lora": None}


def save_random_deepseek_moe(directory, q_lora_rank, seed: int = 0, **overrides):
    """A random fp32 DeepSeek-V3 MoE saved to ``directory``: non-trivial norms, spread router scores and random
    non-zero routing biases."""
    torch.manual_seed(seed)
    cfg = transformers.DeepseekV3Config(**dict(MOE_SHAPE, q_lora_rank=q_lora_rank, **overrides))
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("gate.weight"):  # routers: spread the scores so ties never happen
                p.normal_(0, 1.0)
        for name, t in list(model.named_buffers()) + list(model.named_parameters()):
            if name.endswith("e_score_correction_bias"):
                t.uniform_(-0.5, 0.5)
    model = model.float().eval()
    model.save_pretrained(str(directory))
    return model


@pytest.fixture(scope="module", params=sorted(CASES))
def imported(request, tmp_path_factory):
    src = tmp_path_factory.mktemp(request.param) / "hf"
    save_random_deepseek_moe(src, CASES[request.param])
    bridge = AutoBridge.from_hf_pretrained(src)
    return request.param, src, bridge, bridge.to_megatron_model()


def test_provider_fields(imported):
    case, _, bridge, model = imported
    provider = bridge.to_megatron_provider(load_weights=False)
    assert provider.multi_latent_attention and provider.q_lora_rank == CASES[case]
    assert provider.moe_layer_freq == [0, 1, 1] and provider.num_moe_experts == 8
    assert provider.moe_shared_expert_intermediate_size == 16 and provider.moe_router_enable_expert_bias
    assert (provider.moe_router_num_groups, provider.moe_router_group_topk) == (2, 1)
    names = {n for n, _ in model[0].named_parameters()}
    assert "decoder.layers.0.mlp.linear_fc1_gate.weight" in names
    assert "decoder.layers.1.mlp.shared_experts.linear_fc1.weight" in names
    assert "decoder.layers.2.self_attention.linear_kv_down_proj.weight" in names


def test_logits_equal_transformers_and_routing_biases_matter(imported):
    _, src, _, model = imported
    tokens = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(0))
    reference = hf_logits(load_hf(src), tokens)
    ours = ours_logits(model[0], tokens)
    assert reference.abs().max() > 1.0
    assert (ours - reference).abs().max().item() <= 1e-5
    biases = [m.expert_bias for m in model[0].modules() if getattr(m, "expert_bias", None) is not None]
    assert len(biases) == LAYERS - 1 and all(b.abs().max() > 0.1 for b in biases)
    saved = [b.clone() for b in biases]
    for b in biases:
        b.zero_()
    try:
        assert (ours_logits(model[0], tokens) - reference).abs().max().item() > 1e-3
    finally:
        for b, value in zip(biases, saved):
            b.copy_(value)


def test_export_round_trips(imported, tmp_path):
    _, src, bridge, model = imported
    tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    assert_export_round_trips(bridge, model, src, tmp_path / "out", tokens)
    before, after = read_config(src), read_config(tmp_path / "out")
    for key in ("q_lora_rank", "kv_lora_rank", "first_k_dense_replace", "n_routed_experts", "num_experts_per_tok",
                "n_group", "topk_group", "n_shared_experts", "moe_intermediate_size", "routed_scaling_factor",
                "norm_topk_prob"):
        assert after[key] == before[key], key


def test_greedy_generate_equals_transformers(imported):
    _, src, _, model = imported
    prompt = prompt_ids(VOCAB, 10)
    cached = greedy_ours(model[0], VOCAB, prompt, 12, use_cache=True)
    assert cached == greedy_ours(model[0], VOCAB, prompt, 12, use_cache=False)
    assert cached == greedy_hf(load_hf(src), prompt, 12)


def test_model_built_in_longspan_exports_as_deepseek_v3(imported, tmp_path):
    """An MLA + sigmoid-routed MoE provider (not imported) exports as DeepseekV3ForCausalLM, not GLM."""
    _, _, bridge, model = imported
    provider = bridge.to_megatron_provider(load_weights=False)
    fresh = AutoBridge.from_longspan_provider(provider)
    assert families.family_for_provider(provider).architecture == "DeepseekV3ForCausalLM"
    fresh.save_hf_pretrained(model, tmp_path / "out")
    assert read_config(tmp_path / "out")["num_nextn_predict_layers"] == 0
    tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))
    ours = ours_logits(model[0], tokens)
    assert (ours - hf_logits(load_hf(tmp_path / "out"), tokens)).abs().max().item() <= 1e-5


def test_moe_keys_left_out_of_config_json_take_transformers_defaults(tmp_path):
    """A config.json without the MoE keys means transformers' DeepseekV3Config defaults (3 dense layers, 2.5
    scaling, 8 groups keeping 4, one shared expert), not GLM's."""
    import json

    defaults = transformers.DeepseekV3Config()
    src = tmp_path / "hf"
    save_random_deepseek_moe(src, 24, num_hidden_layers=5)
    cfg = read_config(src)
    for key in ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts",
                "first_k_dense_replace", "n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor"):
        cfg.pop(key)
    (src / "config.json").write_text(json.dumps(cfg))
    provider = AutoBridge.from_hf_pretrained(src).to_megatron_provider(load_weights=False)
    assert provider.num_moe_experts == defaults.n_routed_experts and provider.moe_router_topk == 8
    assert provider.moe_layer_freq == [0] * defaults.first_k_dense_replace + [1, 1]
    assert provider.moe_router_topk_scaling_factor == defaults.routed_scaling_factor
    assert (provider.moe_router_num_groups, provider.moe_router_group_topk) == (defaults.n_group, defaults.topk_group)
    assert provider.moe_shared_expert_intermediate_size == defaults.moe_intermediate_size
