"""GLM-4.5 / 4.6 MoE (Glm4MoeForCausalLM) through AutoBridge: logits equal transformers' (with the routing biases
that change the choice of experts), import -> export is bit-identical with an equivalent config.json, greedy
``generate`` equals transformers' token for token, and unsupported config values fail in one line."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from longspan import AutoBridge
from longspan.conversion import families
from longspan.core.errors import NotSupportedError
from longspan.data.tokenizers import build_tokenizer
from longspan.inference import generate
from longspan.training.config import TokenizerConfig
from tests.conversion.glm_models import make_glm_model
from tests.conversion.hf_models import VOCAB, hf_logits, read_config
from tests.conversion.parity import assert_export_round_trips, tensors

PROMPT = "def hello(world): return world + 1 the quick"
NEW_TOKENS = 12


def _tokens(n=14, seed=0):
    return torch.randint(0, VOCAB, (2, n), generator=torch.Generator().manual_seed(seed))


def _zero_expert_biases(chunk) -> None:
    for module in chunk.modules():
        if getattr(module, "expert_bias", None) is not None:
            module.expert_bias.zero_()


def test_logits_equal_transformers_and_export_is_bit_identical(tmp_path):
    src, out = tmp_path / "hf", tmp_path / "out"
    hf = make_glm_model(src)
    bridge = AutoBridge.from_hf_pretrained(src)
    provider = bridge.to_megatron_provider(load_weights=False)
    assert provider.rotary_percent == 0.5 and provider.add_qkv_bias and not provider.add_bias_linear
    assert provider.moe_layer_freq == [0, 1, 1] and provider.moe_shared_expert_intermediate_size == 16
    assert (provider.moe_router_num_groups, provider.moe_router_group_topk) == (2, 1)
    model = bridge.to_megatron_model()
    tokens = _tokens()
    reference = hf_logits(hf, tokens)
    with torch.no_grad():
        ours = model[0].eval()(tokens)
    diff = (ours - reference).abs().max().item()
    assert diff <= 1e-5, diff

    assert_export_round_trips(bridge, model, src, out, tokens)
    source_cfg = read_config(src)
    regenerated = families.hf_config_dict(families.by_architecture()["Glm4MoeForCausalLM"], provider)
    for key, value in regenerated.items():
        if key in source_cfg and key not in ("dtype", "num_nextn_predict_layers"):
            assert source_cfg[key] == value or source_cfg[key] == pytest.approx(value), key

    # The routing biases matter: without them the same weights route (and predict) differently.
    _zero_expert_biases(model[0])
    with torch.no_grad():
        assert (model[0](tokens) - reference).abs().max().item() > 1e-3


def test_greedy_generate_equals_transformers(tmp_path):
    src = tmp_path / "hf"
    hf = make_glm_model(src, seed=3)
    tokenizer = build_tokenizer(TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(src)))
    prompt_ids = tokenizer.tokenize(PROMPT)
    ids = torch.tensor([prompt_ids])
    hf.config._attn_implementation = "eager"
    expected = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS,
                           eos_token_id=None, pad_token_id=2)[0, len(prompt_ids):].tolist()
    model = AutoBridge.from_hf_pretrained(src).to_megatron_model()
    result = generate(model, tokenizer, PROMPT, max_new_tokens=NEW_TOKENS, eos_ids=())
    assert result.output_ids == expected and len(expected) == NEW_TOKENS


def test_partial_rotary_factor_defaults_as_transformers(tmp_path):
    """config.json without partial_rotary_factor: transformers rotates half of each head; so does the import."""
    src = tmp_path / "hf"
    make_glm_model(src, tokenizer=False)
    cfg = read_config(src)
    cfg["rope_parameters"].pop("partial_rotary_factor")
    (src / "config.json").write_text(json.dumps(cfg))
    assert transformers.AutoConfig.from_pretrained(str(src)).rope_parameters["partial_rotary_factor"] == 0.5
    assert AutoBridge.from_hf_pretrained(src).to_megatron_provider(load_weights=False).rotary_percent == 0.5


@pytest.mark.parametrize("overrides, field", [
    ({"norm_topk_prob": False}, "norm_topk_prob=false"),
    ({"n_group": 4, "topk_group": 2, "num_experts_per_tok": 2}, "topk_group=2"),
    ({"hidden_act": "relu"}, "hidden_act='relu'"),
])
def test_unsupported_config_fails_in_one_line(tmp_path, overrides, field):
    src = tmp_path / "hf"
    make_glm_model(src, tokenizer=False)
    cfg = dict(read_config(src), **overrides)
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(NotSupportedError) as info:
        AutoBridge.from_hf_pretrained(src).to_megatron_provider(load_weights=False)
    message = str(info.value)
    assert field in message and "\n" not in message


def test_longspan_model_with_sigmoid_routing_exports_as_glm(tmp_path):
    """A model built in longspan (not imported) with DeepSeek-V3 routing exports as GLM-4.5 and transformers
    computes its logits."""
    src, out = tmp_path / "hf", tmp_path / "out"
    make_glm_model(src, tokenizer=False)
    bridge = AutoBridge.from_hf_pretrained(src)
    model = bridge.to_megatron_model()
    provider = bridge.to_megatron_provider(load_weights=False)
    assert families.family_for_provider(provider).architecture == "Glm4MoeForCausalLM"
    fresh = AutoBridge.from_longspan_provider(provider)
    fresh.save_hf_pretrained(model, out)
    assert sorted(tensors(out)) == sorted(tensors(src))
    assert read_config(out)["num_nextn_predict_layers"] == 0  # a model built in longspan holds no MTP layers
    tokens = _tokens(seed=2)
    again = transformers.AutoModelForCausalLM.from_pretrained(str(out), attn_implementation="eager").eval()
    with torch.no_grad():
        assert (model[0].eval()(tokens) - hf_logits(again, tokens)).abs().max().item() <= 1e-5


@pytest.mark.parametrize("changes, field", [
    ({"moe_layer_freq": [1, 0, 1]}, "model.moe_layer_freq=[1, 0, 1]"),
    ({"moe_shared_expert_intermediate_size": 24}, "model.moe_shared_expert_intermediate_size=24"),
    ({"moe_router_num_groups": 4, "moe_router_group_topk": 2}, "model.moe_router_group_topk=2"),
])
def test_export_of_a_model_glm_cannot_express_fails_in_one_line(tmp_path, changes, field):
    src = tmp_path / "hf"
    make_glm_model(src, tokenizer=False)
    provider = AutoBridge.from_hf_pretrained(src).to_megatron_provider(load_weights=False)
    for key, value in changes.items():
        setattr(provider, key, value)
    with pytest.raises(NotSupportedError) as info:
        families.hf_config_dict(families.by_architecture()["Glm4MoeForCausalLM"], provider)
    assert field in str(info.value) and "\n" not in str(info.value)
