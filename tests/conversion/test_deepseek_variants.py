"""Kimi K2 and Moonlight load as DeepSeek-V3 (``DeepseekV3ForCausalLM``): a tiny random model with each one's
published config.json, only the sizes shrunk, imports into longspan with transformers' logits and exports
bit-identically (tensors and config.json).

The published values (moonshotai/Kimi-K2-Instruct and moonshotai/Moonlight-16B-A3B on the Hugging Face hub,
config.json; cross-checked against Megatron Bridge's ``KimiK2Provider`` and ``MoonlightModelProvider16B``): both
put one dense layer first, route with sigmoid scores and the aux-loss-free bias (``noaux_tc``) in one group,
normalize the chosen weights and scale them (2.827 / 2.446), use RoPE base 50000. Kimi K2 compresses queries
(``q_lora_rank`` 1536), has YaRN (factor 32 over 4096 positions, beta_fast = beta_slow = 1, both mscales 1),
one shared expert, 8 of 384 experts and norm epsilon 1e-6; Moonlight has no query compression
(``q_lora_rank`` null), no RoPE scaling, two shared experts, 6 of 64 experts and norm epsilon 1e-5 (transformers'
latent norms keep their fixed 1e-6: ``mla_latent_layernorm_epsilon``).

Shrunk: layers, hidden and FFN widths, heads and head widths, latent ranks, expert count and width, vocabulary.
Every other field is as published, in the published spelling (``rope_scaling`` with ``type``, ``rope_theta``,
``model_type`` ``kimi_k2``, Moonshot's token ids). Left out: ``auto_map`` (remote code, which no test runs) and
Kimi K2's ``quantization_config`` (its FP8 block-scaled weights: a storage format longspan does not import, the
tiny weights are fp32); ``torch_dtype`` bfloat16 is written as ``dtype`` float32 for the fp32 weights."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from longspan import AutoBridge
from tests.conversion.parity import hf_logits, ours_logits, read_config, tensors

VOCAB = 96

KIMI_K2 = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001, "bos_token_id": 163584, "eos_token_id": 163585, "ep_size": 1,
    "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02,
    "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 131072, "model_type": "kimi_k2",
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 384, "n_shared_experts": 1,
    "norm_topk_prob": True, "num_attention_heads": 64, "num_experts_per_tok": 8, "num_hidden_layers": 61,
    "num_key_value_heads": 64, "num_nextn_predict_layers": 0, "pretraining_tp": 1, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 50000.0, "routed_scaling_factor": 2.827, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 1, "topk_method": "noaux_tc", "transformers_version": "4.48.3",
    "use_cache": True, "v_head_dim": 128, "vocab_size": 163840,
}
MOONLIGHT = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001, "bos_token_id": 163584, "eos_token_id": 163585, "ep_size": 1,
    "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 11264, "kv_lora_rank": 512, "max_position_embeddings": 8192, "model_type": "deepseek_v3",
    "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64, "n_shared_experts": 2,
    "norm_topk_prob": True, "num_attention_heads": 16, "num_experts_per_tok": 6, "num_hidden_layers": 27,
    "num_key_value_heads": 16, "num_nextn_predict_layers": 0, "pretraining_tp": 1, "q_lora_rank": None,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-05, "rope_theta": 50000.0,
    "routed_scaling_factor": 2.446, "scoring_func": "sigmoid", "seq_aux": True, "tie_word_embeddings": False,
    "topk_group": 1, "topk_method": "noaux_tc", "transformers_version": "4.48.2", "use_cache": True,
    "v_head_dim": 128, "vocab_size": 163840,
}
# the sizes only; q_lora_rank shrinks where it is set (Moonlight's stays null)
SHRUNK = dict(num_hidden_layers=3, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=4,
              kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10, n_routed_experts=12,
              moe_intermediate_size=16, vocab_size=VOCAB)
VARIANTS = {"kimi_k2": KIMI_K2, "moonlight": MOONLIGHT}
# not config values of the model (remote code, the config's own format), or written differently (see above)
_HF_ONLY = ("architectures", "model_type", "transformers_version")


def tiny_config(published: dict) -> dict:
    cfg = dict(published, **SHRUNK, dtype="float32")
    if published["q_lora_rank"] is not None:
        cfg["q_lora_rank"] = 24
    return cfg


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def imported(request, tmp_path_factory):
    """(variant, its tiny config.json, transformers' model, its directory, bridge, longspan's model)."""
    cfg = tiny_config(VARIANTS[request.param])
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        **{k: v for k, v in cfg.items() if k not in _HF_ONLY}))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("gate.weight"):  # routers: spread the scores so top-k never ties
                p.normal_(0, 1.0)
            else:  # weights of a size where a wrong epsilon, scale or rotary factor shows in the logits
                p.normal_(0, 0.15)
        for name, t in list(hf.named_buffers()) + list(hf.named_parameters()):
            if name.endswith("e_score_correction_bias"):
                t.uniform_(-0.5, 0.5)
    hf = hf.float().eval()
    src = tmp_path_factory.mktemp(request.param) / "hf"
    hf.save_pretrained(str(src))
    (src / "config.json").write_text(json.dumps(cfg, indent=2))  # the published spelling, not transformers'
    hf.config._attn_implementation = "eager"
    bridge = AutoBridge.from_hf_pretrained(src)
    return request.param, cfg, hf, src, bridge, bridge.to_megatron_model()


def test_provider_takes_the_published_values(imported):
    variant, cfg, _, _, bridge, _ = imported
    p = bridge.to_megatron_provider(load_weights=False)
    assert p.multi_latent_attention and p.q_lora_rank == cfg["q_lora_rank"]
    assert p.moe_layer_freq == [0, 1, 1] and p.num_moe_experts == 12
    assert p.moe_router_topk == cfg["num_experts_per_tok"] and p.moe_router_score_function == "sigmoid"
    assert p.moe_router_topk_scaling_factor == cfg["routed_scaling_factor"] and p.moe_router_enable_expert_bias
    assert p.moe_shared_expert_intermediate_size == 16 * cfg["n_shared_experts"]
    assert p.rotary_base == 50000.0 and p.layernorm_epsilon == cfg["rms_norm_eps"]
    if variant == "kimi_k2":
        assert p.position_embedding_type == "yarn" and p.rotary_scaling_factor == 32.0
        assert (p.yarn_beta_fast, p.yarn_beta_slow, p.mscale, p.mscale_all_dim) == (1.0, 1.0, 1.0, 1.0)
        assert p.yarn_original_max_position_embeddings == 4096
        assert p.mla_latent_layernorm_epsilon is None
    else:
        assert p.position_embedding_type == "rope" and p.mla_latent_layernorm_epsilon == 1e-6


def test_logits_equal_transformers(imported):
    variant, _, hf, _, _, model = imported
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    theirs = hf_logits(hf, tokens)
    ours = ours_logits(model[0], tokens)
    assert theirs.abs().max() > 1.0  # logits of a size where a wrong scale would show
    assert (ours - theirs).abs().max().item() <= 1e-4, variant
    if variant == "moonlight":  # the latent norms have transformers' 1e-6, the others rms_norm_eps
        layer = model[0].decoder.layers["1"]
        assert layer.self_attention.kv_layernorm.eps == 1e-6 and layer.input_layernorm.eps == 1e-5


def test_export_is_bit_identical(imported, tmp_path):
    _, cfg, _, src, bridge, model = imported
    bridge.save_hf_pretrained(model, tmp_path / "out")
    original, exported = tensors(src), tensors(tmp_path / "out")
    assert sorted(original) == sorted(exported)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    assert read_config(tmp_path / "out") == cfg
