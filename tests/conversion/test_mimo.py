"""MiMo-V2-Flash (``MiMoV2FlashForCausalLM``) through AutoBridge, on one tiny random model made with transformers'
MiMoV2FlashConfig: sliding-window layers (window 5) with twice the full-attention layers' KV heads and random
learned sinks, values narrower than queries and keys (8 vs 12) scaled by 0.6, a RoPE base per layer kind over a
third of each head, sigmoid-routed MoE over two expert groups with random routing biases on the layers
``mlp_layer_types`` marks (sparse, dense, sparse, sparse).

Checked: the provider's fields and the per-layer modules; logits equal transformers' (fp32, <= 1e-5) on a
40-token prompt (eight windows); import -> export bit-identical (tensor names, dtypes, config.json); greedy
generation with the KV cache token for token; a launched TP2 import -> export bit-identical; LoRA on the
attention and MLP projections; transformers' default config translates; bad inputs exit 2 / raise with one line."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from longspan import AutoBridge
from longspan.cli import main
from longspan.conversion import families
from longspan.core.errors import ConfigError, NotSupportedError
from longspan.families.mimo.model import MiMoAttention
from longspan.peft import LoRA
from longspan.peft.modules import LoRALinear
from tests.conversion.parity import (
    assert_export_round_trips,
    greedy_hf,
    greedy_ours,
    hf_logits,
    load_hf,
    prompt_ids,
    read_config,
    tensors,
)

VOCAB = 96
ARCH = "MiMoV2FlashForCausalLM"
FULL, SLIDING = "full_attention", "sliding_attention"
SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, moe_intermediate_size=12, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=2, head_dim=12, v_head_dim=8, attention_value_scale=0.6,
             sliding_window=5, layer_types=[FULL, SLIDING, SLIDING, FULL],
             mlp_layer_types=["sparse", "dense", "sparse", "sparse"], n_routed_experts=8, num_experts_per_tok=2,
             n_group=2, topk_group=1, routed_scaling_factor=1.5, norm_topk_prob=True, rms_norm_eps=1e-5,
             max_position_embeddings=64, initializer_range=0.1, tie_word_embeddings=False, eos_token_id=1,
             pad_token_id=2,
             rope_parameters={FULL: {"rope_type": "default", "rope_theta": 50000.0, "partial_rotary_factor": 0.334},
                              SLIDING: {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.334}})
TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]  # Megatron's names (linear_qkv: q, k and v)


def make_mimo(directory, seed: int = 0):
    """Save a random fp32 MiMo-V2-Flash to ``directory`` (norms around 1, spread routers and sinks, non-zero
    routing biases); returns the transformers model."""
    torch.manual_seed(seed)
    model = transformers.MiMoV2FlashForCausalLM(transformers.MiMoV2FlashConfig(**SHAPE))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("gate.weight") or name.endswith("sinks"):  # spread routers; sinks that matter
                p.normal_(0, 1.0)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.uniform_(-0.5, 0.5)
    model = model.float().eval()
    model.save_pretrained(str(directory))
    return model


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    src = tmp_path_factory.mktemp("mimo") / "hf"
    hf = make_mimo(src)
    bridge = AutoBridge.from_hf_pretrained(src)
    return src, hf, bridge, bridge.to_megatron_model()


def test_provider_fields_and_per_layer_attention(imported):
    _, _, bridge, model = imported
    p = bridge.to_megatron_provider(load_weights=False)
    assert type(p).__name__ == "MiMoV2FlashModelProvider"
    assert (p.num_query_groups, p.window_num_query_groups, p.kv_channels, p.v_head_dim) == (2, 4, 12, 8)
    assert (p.softmax_type, p.window_softmax_type, p.attention_value_scale) == ("vanilla", "learnable", 0.6)
    assert (p.rotary_base, p.rotary_percent, p.rope_scaling_factor) == ([500, 50000], 0.334, 1.0)
    assert p.window_size == [4, 0] and p.window_attn_skip_freq == [0, 1, 1, 0]
    assert p.moe_layer_freq == [1, 0, 1, 1] and (p.moe_router_num_groups, p.moe_router_group_topk) == (2, 1)
    assert p.moe_shared_expert_intermediate_size is None and p.moe_router_topk_scaling_factor == 1.5
    layers = model[0].decoder.layers
    for i, sliding in enumerate([False, True, True, False]):
        attention = layers[str(i)].self_attention
        assert isinstance(attention, MiMoAttention) and attention.window == (5 if sliding else None)
        assert attention.linear_k.weight.shape == ((4 if sliding else 2) * 12, 32)
        assert attention.linear_v.weight.shape == ((4 if sliding else 2) * 8, 32)
        assert attention.linear_proj.weight.shape == (32, 8 * 8)
        assert (attention.softmax_offset is not None) == sliding


def test_logits_equal_transformers_and_export_is_bit_identical(imported, tmp_path):
    src, hf, bridge, model = imported
    tokens = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(0))
    reference = hf_logits(hf, tokens)
    with torch.no_grad():
        ours = model[0].eval()(tokens)
    diff = (ours - reference).abs().max().item()
    assert diff <= 1e-5, diff  # tighter than the 1e-4 (measured 8.9e-7)

    out = tmp_path / "out"
    assert_export_round_trips(bridge, model, src, out, tokens)
    assert "model.layers.1.self_attn.attention_sink_bias" in tensors(out)
    assert read_config(out) == read_config(src)
    regenerated = families.hf_config_dict(families.by_architecture()[ARCH], bridge.to_megatron_provider(False))
    source = read_config(src)
    assert regenerated["mlp_layer_types"] == SHAPE["mlp_layer_types"]
    assert regenerated["rope_parameters"] == SHAPE["rope_parameters"]
    for key, value in regenerated.items():
        assert key in source, key
        assert source[key] == value or source[key] == pytest.approx(value), key


def test_greedy_generate_with_the_cache_equals_transformers(imported):
    """A 24-token prompt and 12 new tokens: the sliding layers' cache keeps only its window, the full layers'
    cache holds values narrower than their keys."""
    src, _, _, model = imported
    prompt = prompt_ids(VOCAB, 24)
    expected = greedy_hf(load_hf(src), prompt, 12)
    assert greedy_ours(model, VOCAB, prompt, 12) == expected and len(expected) == 12


def test_lora_targets_reach_the_attention_and_mlp_projections(imported):
    src, _, bridge, _ = imported
    model = AutoBridge.from_hf_pretrained(src).to_megatron_model()[0]
    LoRA(target_modules=TARGETS, dim=4, alpha=8).apply(model)
    adapted = {n for n, m in model.named_modules() if isinstance(m, LoRALinear)}
    for i in range(4):  # the full and the sliding layers' q / k / v (of their own widths) and output projection
        assert {f"decoder.layers.{i}.self_attention.{t}" for t in ("linear_q", "linear_k", "linear_v",
                                                                   "linear_proj")} <= adapted
    assert "decoder.layers.1.mlp.linear_fc1" in adapted and "decoder.layers.0.mlp.experts.linear_fc1" not in adapted
    assert bridge.hf_module_name("decoder.layers.1.self_attention.linear_v") == "model.layers.1.self_attn.v_proj"
    loss = model(torch.arange(12).view(1, 12), labels=torch.arange(1, 13).view(1, 12)).mean()
    loss.backward()  # the adapters of the narrow value projections get gradients
    assert model.decoder.layers["1"].self_attention.linear_v.adapter.linear_out.weight.grad is not None


def test_transformers_default_config_translates():
    """MiMoV2FlashConfig's defaults (its docstring: the released model's shape): 48 layers, layer 0 and every sixth
    full attention, layer 0 dense, 256 experts."""
    cfg = transformers.MiMoV2FlashConfig().to_dict()
    p = AutoBridge.from_hf_config(cfg).to_megatron_provider(load_weights=False)
    full = [i for i, flag in enumerate(p.window_attn_skip_freq) if not flag]
    assert full == [0, 5, 11, 17, 23, 29, 35, 41, 47] and p.window_size == [128, 0]
    assert p.moe_layer_freq == [0] + [1] * 47 and (p.num_moe_experts, p.moe_router_topk) == (256, 8)
    assert (p.num_query_groups, p.window_num_query_groups, p.kv_channels, p.v_head_dim) == (4, 8, 192, 128)
    assert p.rotary_base == [10000, 5000000] and p.attention_value_scale == 0.707


def test_bad_layouts_and_exports_raise_one_line(imported):
    provider = imported[2].to_megatron_provider(load_weights=False)
    provider.window_num_query_groups, provider.tensor_model_parallel_size = 1, 2
    with pytest.raises(ConfigError, match=r"model.window_num_query_groups=1 with tensor_model_parallel_size=2") as e:
        provider.provide_meta()
    assert "\n" not in str(e.value)
    family = families.by_architecture()[ARCH]
    for change, message in (({"window_num_query_groups": 2}, "model.window_num_query_groups=2 has no MiMo"),
                            ({"mtp_num_layers": 1}, "model.mtp_num_layers=1 has no MiMo-V2-Flash HF equivalent")):
        provider = imported[2].to_megatron_provider(load_weights=False)
        for name, value in change.items():
            setattr(provider, name, value)
        with pytest.raises(NotSupportedError, match=message) as e:
            families.hf_config_dict(family, provider)
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("change, message", [
    ({"num_key_value_heads": 8}, "config.json num_key_value_heads=8: MiMo-V2-Flash's sliding-window layers have 2 * "
                                 "num_key_value_heads = 16 KV heads, which must divide num_attention_heads=8"),
    ({"layer_types": [FULL, SLIDING, "chunked_attention", FULL]}, "config.json layer_types="),
])
def test_bad_config_exits_2_in_one_line(imported, tmp_path, capsys, change, message):
    src = tmp_path / "hf"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(dict(read_config(imported[0]), **change)))
    (src / "model.safetensors").symlink_to(imported[0] / "model.safetensors")
    capsys.readouterr()
    assert main(["convert", "import", "--hf-model", str(src), "--output", str(tmp_path / "c"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err, err


@pytest.mark.slow
def test_launched_tensor_parallel_import_then_export_round_trips(imported, tmp_path, pool2):
    """Two workers: each holds half the heads, of the full layers' 2 KV groups one, of the sliding layers' 4 two,
    and half of each sliding layer's sinks."""
    src, ckpt, out = imported[0], tmp_path / "ckpt", tmp_path / "out"
    layout = "model.tensor_model_parallel_size=2"
    assert pool2.run(main, ["convert", "import", "--hf-model", str(src), "--output", str(ckpt), "--no-progress",
                            layout], timeout=240) == [0, 0]
    assert pool2.run(main, ["convert", "export", "--checkpoint", str(ckpt), "--output", str(out), "--no-progress",
                            layout], timeout=240) == [0, 0]
    original, exported = tensors(src), tensors(out)
    assert sorted(original) == sorted(exported)
    assert all(exported[k].dtype == v.dtype and torch.equal(exported[k], v) for k, v in original.items())
    assert read_config(out) == read_config(src)
