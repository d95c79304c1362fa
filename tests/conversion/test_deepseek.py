"""DeepSeek-V3 (dense: every layer has the dense MLP) from config.json: multi-latent attention with and without
query compression, RoPE and YaRN. Logits equal transformers' (fp32 <= 1e-5), export is bit-identical, greedy
generation with the latent KV cache equals recompute and transformers' generate token for token."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from longspan import AutoBridge
from longspan.core.errors import NotSupportedError
from longspan.models.transformer import KVCache
from tests.conversion.parity import (
    assert_export_round_trips,
    greedy_hf,
    greedy_ours,
    hf_logits,
    load_hf,
    ours_logits,
    prompt_ids,
    save_random_model,
)

VOCAB, LAYERS, HEADS, HIDDEN = 96, 3, 4, 64
KV_LORA, NOPE, ROPE, V = 16, 12, 8, 10
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 1.0}
DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}


def deepseek_config(q_lora_rank, rope=DEFAULT_ROPE, **overrides) -> transformers.DeepseekV3Config:
    kw = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=LAYERS,
              num_attention_heads=HEADS, num_key_value_heads=HEADS, q_lora_rank=q_lora_rank, kv_lora_rank=KV_LORA,
              qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V, first_k_dense_replace=LAYERS,
              max_position_embeddings=128, initializer_range=0.15, tie_word_embeddings=False, attention_dropout=0.0,
              rope_parameters=dict(rope))
    kw.update(overrides)
    return transformers.DeepseekV3Config(**kw)


CASES = {"q_lora": (24, DEFAULT_ROPE), "no_q_lora": (None, DEFAULT_ROPE), "q_lora_yarn": (24, YARN)}


@pytest.fixture(scope="module", params=sorted(CASES))
def imported(request, tmp_path_factory):
    q_lora_rank, rope = CASES[request.param]
    src = tmp_path_factory.mktemp(request.param) / "hf"
    save_random_model(deepseek_config(q_lora_rank, rope), src)
    bridge = AutoBridge.from_hf_pretrained(src)
    return request.param, src, bridge, bridge.to_megatron_model()


def test_provider_fields(imported):
    case, _, _, model = imported
    args = model[0].args
    assert args.mla is not None and args.mla.q_lora_rank == CASES[case][0]
    assert (args.mla.kv_lora_rank, args.mla.qk_head_dim, args.mla.qk_pos_emb_head_dim, args.mla.v_head_dim) == (
        KV_LORA, NOPE, ROPE, V)
    names = {n for n, _ in model[0].named_parameters()}
    with_q_lora = "decoder.layers.0.self_attention.linear_q_down_proj.weight" in names
    assert with_q_lora == (CASES[case][0] is not None)
    assert ("decoder.layers.0.self_attention.linear_q_proj.weight" in names) == (not with_q_lora)


def test_logits_equal_transformers(imported):
    _, src, _, model = imported
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))  # > YaRN's original 16
    ours, theirs = ours_logits(model[0], tokens), hf_logits(load_hf(src), tokens)
    assert theirs.abs().max() > 1.0  # logits of a size where a wrong scale would show
    assert (ours - theirs).abs().max().item() <= 1e-5


def test_export_round_trips(imported, tmp_path):
    _, src, bridge, model = imported
    tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    assert_export_round_trips(bridge, model, src, tmp_path / "out", tokens)
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    for key in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        assert exported[key] == json.loads((src / "config.json").read_text())[key], key


def test_greedy_generate_equals_transformers_and_recompute(imported):
    _, src, _, model = imported
    prompt = prompt_ids(VOCAB, 10)
    cached = greedy_ours(model[0], VOCAB, prompt, 12, use_cache=True)
    assert cached == greedy_ours(model[0], VOCAB, prompt, 12, use_cache=False)
    assert cached == greedy_hf(load_hf(src), prompt, 12)


def test_cache_holds_the_latent(imported):
    """The cache keeps kv_lora_rank + qk_pos_emb_head_dim numbers per token and layer, not full keys and values;
    the cached forward's logits equal the uncached forward's."""
    _, _, _, model = imported
    gpt = model[0].eval()
    tokens = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(2))
    cache = KVCache(16)
    with torch.no_grad():
        first = gpt(tokens[:, :6], kv_cache=cache)
        rest = gpt(tokens[:, 6:], kv_cache=cache)
        full = gpt(tokens)
    assert torch.allclose(torch.cat([first, rest], dim=1), full, atol=1e-5, rtol=0)
    assert not cache.keys and not cache.values
    assert sorted(cache.latents) == list(range(LAYERS))
    per_token = cache.nbytes() // (16 * LAYERS * 4)  # fp32 numbers per position and layer
    assert per_token == KV_LORA + ROPE
    # a plain attention of the same width caches keys and values of every head: 2 * heads * head_dim
    assert 2 * HEADS * (NOPE + ROPE) > per_token


def test_yarn_softmax_scale_matters(tmp_path):
    """mscale_all_dim scales the softmax (mscale^2): changing it changes the logits (and transformers agrees)."""
    tokens = torch.randint(0, VOCAB, (1, 20), generator=torch.Generator().manual_seed(0))
    logits = []
    for all_dim in (1.0, 0.5):
        src = tmp_path / f"hf{all_dim}"
        save_random_model(deepseek_config(24, dict(YARN, mscale=all_dim, mscale_all_dim=all_dim)), src)
        model = AutoBridge.from_hf_pretrained(src).to_megatron_model()[0]
        ours = ours_logits(model, tokens)
        assert (ours - hf_logits(load_hf(src), tokens)).abs().max().item() <= 1e-5
        logits.append(ours)
    assert (logits[0] - logits[1]).abs().max() > 1e-3


@pytest.mark.parametrize("overrides, match", [
    (dict(rope_interleave=False), "rope_interleave=false"),
    (dict(attention_bias=True), "attention_bias=true"),
])
def test_unsupported_configs_fail_in_one_line(tmp_path, overrides, match):
    cfg = deepseek_config(24).to_dict()
    cfg.update(overrides)
    cfg["architectures"] = ["DeepseekV3ForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(NotSupportedError, match=match) as info:
        AutoBridge.from_hf_pretrained(tmp_path).to_megatron_provider()
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("rope", [
    dict(position_embedding_type="rope"),
    # mscale without mscale_all_dim: transformers ignores mscale, so the export writes the factor it stands for
    dict(position_embedding_type="yarn", yarn_original_max_position_embeddings=16, rotary_scaling_factor=4.0,
         mscale=0.7, mscale_all_dim=0.0),
    dict(position_embedding_type="yarn", yarn_original_max_position_embeddings=16, rotary_scaling_factor=4.0,
         mscale=0.9, mscale_all_dim=0.6),
], ids=["rope", "yarn_mscale_only", "yarn_both_mscales"])
def test_model_built_in_longspan_exports_as_deepseek_v3(rope, tmp_path):
    """A multi-latent attention model trained from scratch exports as DeepseekV3ForCausalLM: transformers reads
    it back and computes the same logits."""
    from longspan.models.gpt import build_gpt_model
    from tests.models.test_mla import mla_config

    provider = mla_config(vocab_size=VOCAB, make_vocab_size_divisible_by=32, init_method_std=0.15,
                          layernorm_epsilon=1e-6, **rope)
    model = build_gpt_model(provider, seed=3).eval()
    bridge = AutoBridge.from_longspan_provider(provider)
    assert bridge.family.architecture == "DeepseekV3ForCausalLM"
    bridge.save_hf_pretrained(model, tmp_path / "hf")
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(4))
    ours, theirs = ours_logits(model, tokens)[..., :VOCAB], hf_logits(load_hf(tmp_path / "hf"), tokens)
    assert (ours - theirs).abs().max().item() <= 1e-5


def test_export_refuses_what_transformers_cannot_express():
    from tests.models.test_mla import mla_config

    provider = mla_config(mscale_all_dim=0.5, layernorm_epsilon=1e-6)  # a softmax mscale without YaRN
    with pytest.raises(NotSupportedError, match="mscale_all_dim=0.5"):
        AutoBridge.from_longspan_provider(provider).family.to_hf(provider)
    provider = mla_config(layernorm_epsilon=1e-5)  # transformers' latent norms have eps 1e-6
    with pytest.raises(NotSupportedError, match="layernorm_epsilon=1e-05"):
        AutoBridge.from_longspan_provider(provider).family.to_hf(provider)
