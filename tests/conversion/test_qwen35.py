"""Qwen3.5 (``Qwen3_5ForCausalLM``), Qwen3.5-MoE (``Qwen3_5MoeForCausalLM``), Qwen3-Next
(``Qwen3NextForCausalLM``) and ``Qwen3_5ForConditionalGeneration`` on text: tiny random models made
with transformers' config classes (uneven head counts, value heads a multiple of key heads, non-trivial norms,
the (1 + w) norms away from zero) have transformers' logits in longspan, export bit-identically, and generate
greedily token for token as transformers does, with and without the cache; tied and untied."""

from __future__ import annotations

import pytest
import torch
import transformers

from longspan import AutoBridge
from longspan.conversion import families
from longspan.core.errors import CheckpointError
from tests.conversion.parity import (
    assert_export_round_trips,
    greedy_hf,
    greedy_ours,
    hf_logits,
    prompt_ids,
    read_config,
    tensors,
)

VOCAB = 96
# Uneven: 6 heads of width 8 over 2 KV groups; DeltaNet with 2 key heads of width 6 and 6 value heads of width 4;
# 6 layers, full attention on layers 3 and 5 (not the default every-4th); partial RoPE on half of each head.
SHAPE = dict(vocab_size=VOCAB, hidden_size=24, num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=2,
             head_dim=8, linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=6,
             linear_value_head_dim=4, linear_conv_kernel_dim=3, max_position_embeddings=128, rms_norm_eps=1e-6,
             layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention",
                          "linear_attention", "full_attention"],
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
MOE = dict(num_experts=5, num_experts_per_tok=2, moe_intermediate_size=12, shared_expert_intermediate_size=20)


def _config(kind: str, tied: bool):
    if kind == "dense":
        return transformers.Qwen3_5TextConfig(**SHAPE, intermediate_size=40, tie_word_embeddings=tied)
    if kind == "moe":
        return transformers.Qwen3_5MoeTextConfig(**SHAPE, **MOE, tie_word_embeddings=tied)
    if kind == "next":  # a dense layer among the MoE ones (mlp_only_layers)
        return transformers.Qwen3NextConfig(**SHAPE, **MOE, intermediate_size=40, mlp_only_layers=[1],
                                            norm_topk_prob=True, tie_word_embeddings=tied)
    raise ValueError(kind)


def _randomize(model, seed: int) -> None:
    """Non-trivial norms (the (1 + w) ones and the gated norm), spread routers, decays in a useful range."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.empty(p.shape).uniform_(-0.4, 0.4, generator=g) + (1.0 if "linear_attn.norm" in name
                                                                                  else 0.0))
            elif name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(-1.0, 1.0, generator=g))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def make_model(kind: str, directory, tied: bool = False, seed: int = 0):
    """Save a random fp32 model of ``kind`` to ``directory``; returns it (eager attention, eval)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(_config(kind, tied))
    _randomize(model, seed)
    model = model.float().eval()
    model.save_pretrained(str(directory))
    model.config._attn_implementation = "eager"
    return model


def _tokens(n: int = 70, seed: int = 0) -> torch.Tensor:
    # longer than one chunk of the rule (64) so the chunked form carries state between chunks
    return torch.randint(0, VOCAB, (2, n), generator=torch.Generator().manual_seed(seed))


CASES = [("dense", False), ("dense", True), ("moe", False), ("moe", True), ("next", False), ("next", True)]


@pytest.mark.parametrize("kind,tied", CASES)
def test_logits_equal_transformers_and_export_is_bit_identical(tmp_path, kind, tied):
    src, out = tmp_path / "hf", tmp_path / "out"
    hf = make_model(kind, src, tied)
    bridge = AutoBridge.from_hf_pretrained(src)
    provider = bridge.to_megatron_provider(load_weights=False)
    assert provider.experimental_attention_variant == "gated_delta_net" and provider.attention_output_gate
    assert provider.linear_attention_freq == [1, 1, 1, 0, 1, 0] and provider.rotary_percent == 0.5
    assert provider.share_embeddings_and_output_weights is tied
    model = bridge.to_megatron_model()
    tokens = _tokens()
    with torch.no_grad():
        ours = model[0].eval()(tokens)
    diff = (ours - hf_logits(hf, tokens)).abs().max().item()
    assert diff <= 1e-4, diff

    assert_export_round_trips(bridge, model, src, out, tokens)
    # config.json regenerated from the provider alone keeps every key the source had, with its value
    source = read_config(src)
    regenerated = families.hf_config_dict(bridge.family, provider)
    for key, value in regenerated.items():
        if key in source and key not in ("dtype", "rope_parameters"):
            assert source[key] == value or source[key] == pytest.approx(value), key


@pytest.mark.parametrize("kind,tied", [("dense", False), ("moe", True), ("next", False)])
def test_a_model_exported_by_architecture_loads_in_transformers(tmp_path, kind, tied):
    """The provider's own config.json (not the source's) makes transformers compute the same logits."""
    src, out = tmp_path / "hf", tmp_path / "out"
    make_model(kind, src, tied, seed=1)
    bridge = AutoBridge.from_hf_pretrained(src)
    model = bridge.to_megatron_model()
    provider = bridge.to_megatron_provider(load_weights=False)
    AutoBridge.from_longspan_provider(provider, bridge.family.architecture).save_hf_pretrained(model, out)
    again = transformers.AutoModelForCausalLM.from_pretrained(str(out), attn_implementation="eager").float().eval()
    assert type(again).__name__ == bridge.family.architecture
    assert sorted(tensors(out)) == sorted(tensors(src))
    tokens = _tokens(seed=1)
    with torch.no_grad():
        assert (model[0].eval()(tokens) - hf_logits(again, tokens)).abs().max().item() <= 1e-4


@pytest.mark.parametrize("kind,tied", [("dense", False), ("dense", True), ("moe", False), ("next", True)])
@pytest.mark.parametrize("use_cache", [True, False])
def test_greedy_generate_equals_transformers(tmp_path, kind, tied, use_cache):
    src = tmp_path / "hf"
    hf = make_model(kind, src, tied, seed=3)
    prompt = prompt_ids(VOCAB, 40)
    expected = greedy_hf(hf, prompt, 12, use_cache=use_cache)
    model = AutoBridge.from_hf_pretrained(src).to_megatron_model()
    assert greedy_ours(model, VOCAB, prompt, 12, use_cache=use_cache) == expected


def _save_vl(directory, tied: bool, seed: int = 0):
    text = transformers.Qwen3_5TextConfig(**SHAPE, intermediate_size=40, tie_word_embeddings=tied)
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=24, patch_size=4,
                  temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)
    cfg = transformers.Qwen3_5Config(text_config=text.to_dict(), vision_config=vision, tie_word_embeddings=tied)
    torch.manual_seed(seed)
    model = transformers.Qwen3_5ForConditionalGeneration(cfg)
    _randomize(model, seed)
    model = model.float().eval()
    model.save_pretrained(str(directory))
    model.config._attn_implementation = "eager"
    return model


@pytest.mark.parametrize("tied", [False, True])
def test_text_tower_of_the_vision_language_model(tmp_path, tied):
    """Qwen3_5ForConditionalGeneration imports whole (``longspan.families.qwen3_vl``: the encoder on this language
    model): its text logits equal the vision-language model's, and it exports bit-identical under its own
    architecture (images: tests/models/vlm/test_qwen35_vl.py)."""
    src, out = tmp_path / "hf", tmp_path / "out"
    hf = _save_vl(src, tied)
    bridge = AutoBridge.from_hf_pretrained(src)
    model = bridge.to_megatron_model()
    tokens = _tokens(seed=2)
    with torch.no_grad():
        diff = (model[0].eval()(tokens) - hf(input_ids=tokens).logits).abs().max().item()
    assert diff <= 1e-4, diff
    bridge.save_hf_pretrained(model, out)
    assert read_config(out)["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    original, exported = tensors(src), tensors(out)
    assert sorted(original) == sorted(exported)
    for name, tensor in exported.items():
        assert torch.equal(original[name], tensor), name
    again = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(str(out), attn_implementation="eager")
    with torch.no_grad():
        assert (hf_logits(again.float().eval(), tokens) - hf(input_ids=tokens).logits).abs().max().item() <= 1e-4


def test_a_checkpoint_whose_deltanet_tensors_do_not_fit_is_refused_in_one_line(tmp_path):
    src = tmp_path / "hf"
    make_model("dense", src)
    bridge = AutoBridge.from_hf_pretrained(src)
    bridge.hf_config["linear_num_value_heads"] = 4  # the files hold 6 value heads
    bridge = AutoBridge(bridge.hf_config, bridge.family, src)
    misfit = r"shape mismatch: HF tensor model\.layers\.0\.linear_attn\.\S+ has shape"
    with pytest.raises(CheckpointError, match=misfit):
        bridge.to_megatron_model()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dense", "moe", "next"])
def test_launched_tensor_parallel_import_then_export_round_trips(tmp_path, pool2, kind):
    """Two workers: the import and the export with the DeltaNet heads, attention heads and (for Qwen3-Next's
    interleaved fusions) each rank's slices of the fused tensors split over two ranks."""
    from longspan.cli import main

    src, ckpt, out = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "out"
    make_model(kind, src)
    layout = "model.tensor_model_parallel_size=2"
    assert pool2.run(main, ["convert", "import", "--hf-model", str(src), "--output", str(ckpt), "--no-progress",
                            layout], timeout=240) == [0, 0]
    assert pool2.run(main, ["convert", "export", "--checkpoint", str(ckpt), "--output", str(out), "--no-progress",
                            layout], timeout=240) == [0, 0]
    original, exported = tensors(src), tensors(out)
    assert sorted(original) == sorted(exported) and all(torch.equal(exported[k], v) for k, v in original.items())
    assert read_config(out)["architectures"] == read_config(src)["architectures"]
