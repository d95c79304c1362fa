"""Gemma 4 (``Gemma4ForCausalLM``, the text tower of ``Gemma4ForConditionalGeneration``): one tiny random model
with every dense feature (wider full-attention heads with one KV head and keys as values, proportional RoPE,
the last three layers reusing earlier layers' keys and values with double-wide MLPs, per-layer inputs with
their own vocabulary, final soft-capping, non-trivial norms and layer scalars) has transformers' logits on a
prompt longer than the window, exports bit-identically, generates greedily as transformers does with no cache
in the KV-shared layers, and what longspan cannot build is refused in one line. A second one adds the MoE block
(routed experts beside the dense MLP): logits, export and generation, and the launched TP2 round trip."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers

from longspan import AutoBridge
from longspan.cli import main
from longspan.conversion import families
from longspan.core.errors import ConfigError, NotSupportedError
from longspan.models.transformer import KVCache
from longspan.peft import LoRA
from tests.conversion.parity import greedy_hf, greedy_ours, prompt_ids, read_config, tensors

VOCAB = 96
WINDOW = 5
KINDS = ["sliding_attention", "full_attention", "sliding_attention", "full_attention", "sliding_attention",
         "full_attention"]
TEXT = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=24, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, global_head_dim=16, num_global_key_value_heads=1,
            attention_k_eq_v=True, sliding_window=WINDOW, layer_types=KINDS, num_kv_shared_layers=3,
            use_double_wide_mlp=True, hidden_size_per_layer_input=4, vocab_size_per_layer_input=VOCAB + 7,
            final_logit_softcapping=30.0, max_position_embeddings=64, tie_word_embeddings=True,
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                "rope_theta": 1000000.0}})
MOE = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=8)
SHARED = (3, 4, 5)  # the KV-shared layers: 3 and 5 reuse layer 1's keys and values, 4 reuses layer 2's


def _randomize(model) -> None:
    """Norms, layer scalars and the router's scales away from one; weights as drawn."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(("router.scale", "router.per_expert_scale")):
                p.uniform_(0.5, 1.5)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.uniform_(0.5, 1.5)


def save_gemma4(directory, **overrides) -> transformers.Gemma4ForCausalLM:
    torch.manual_seed(0)
    model = transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(**dict(TEXT, **overrides)))
    _randomize(model)
    model = model.float().eval()
    model.save_pretrained(str(directory))
    model.config._attn_implementation = "eager"
    return model


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
    """(HF model, its directory, longspan's bridge and model) of the module's one tiny Gemma 4."""
    src = tmp_path_factory.mktemp("gemma4") / "hf"
    hf = save_gemma4(src)
    bridge = AutoBridge.from_hf_pretrained(src)
    return hf, src, bridge, bridge.to_megatron_model()


@pytest.fixture(scope="module")
def gemma4_moe(tmp_path_factory):
    """The same model with the MoE block (26B-A4B's shape in small: four experts, two per token)."""
    src = tmp_path_factory.mktemp("gemma4_moe") / "hf"
    hf = save_gemma4(src, **MOE)
    bridge = AutoBridge.from_hf_pretrained(src)
    return hf, src, bridge, bridge.to_megatron_model()


def _tokens(n: int = 14, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, n), generator=torch.Generator().manual_seed(seed))


def test_logits_equal_transformers(gemma4):
    hf, _, bridge, model = gemma4
    provider = bridge.to_megatron_provider(load_weights=False)
    assert (provider.global_kv_channels, provider.num_global_query_groups) == (16, 1)
    assert provider.rotary_base == [10000, 1000000] and provider.global_rotary_percent == 0.25
    assert provider.window_size == [WINDOW - 1, 0] and provider.softmax_scale == 1.0
    layers = model[0].decoder.layers
    assert layers["1"].self_attention.linear_v is None and layers["0"].self_attention.linear_v is not None
    assert all(layers[str(i)].self_attention.linear_k is None for i in SHARED)
    assert layers["5"].mlp.linear_fc1.weight.shape[0] == 2 * layers["1"].mlp.linear_fc1.weight.shape[0]
    tokens = _tokens()  # 14 positions, window 5
    with torch.no_grad():
        ours = model[0].eval()(tokens)
        diff = (ours - hf(input_ids=tokens).logits).abs().max().item()
    assert diff <= 1e-4, diff


def test_export_is_bit_identical_and_loads_in_transformers(gemma4, tmp_path):
    hf, src, bridge, model = gemma4
    out = tmp_path / "out"
    bridge.save_hf_pretrained(model, out)
    original, exported = tensors(src), tensors(out)
    assert sorted(original) == sorted(exported)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    assert read_config(out) == read_config(src)
    again = transformers.AutoModelForCausalLM.from_pretrained(str(out), attn_implementation="eager").eval()
    tokens = _tokens(seed=1)
    with torch.no_grad():
        assert torch.equal(again(input_ids=tokens).logits, hf(input_ids=tokens).logits)


def test_greedy_generate_equals_transformers_and_shared_layers_hold_no_cache(gemma4):
    hf, _, _, model = gemma4
    prompt = prompt_ids(VOCAB, 12)  # longer than the window
    assert greedy_ours(model, VOCAB, prompt, 8) == greedy_hf(hf, prompt, 8)
    cache = KVCache(32)
    with torch.no_grad():
        model[0].eval()(torch.tensor([prompt]), kv_cache=cache)
    assert sorted(cache.keys) == [0, 1, 2]


def test_moe_block_logits_export_and_generate_equal_transformers(gemma4_moe, tmp_path):
    """The MoE block beside the dense MLP: transformers' logits with the expert loop and with grouped GEMMs,
    a bit-identical export (``gate_up_proj`` rebuilt from the gate and up slabs) and greedy generation."""
    hf, src, bridge, model = gemma4_moe
    provider = bridge.to_megatron_provider(load_weights=False)
    assert (provider.num_moe_experts, provider.moe_router_topk, provider.moe_ffn_hidden_size) == (4, 2, 8)
    moe = model[0].decoder.layers["5"].mlp
    assert moe.shared_experts.linear_fc1.weight.shape == (48, 32)  # the dense MLP, double-wide on a shared layer
    assert moe.experts.linear_fc1_gate.weight.shape == (4, 8, 32) and moe.router.per_expert_scale.shape == (4,)
    tokens = _tokens()
    with torch.no_grad():
        expected = hf(input_ids=tokens).logits
        loop = model[0].eval()(tokens)
        for layer in model[0].decoder.layers.values():
            layer.mlp.experts.grouped_gemm = True
        grouped = model[0](tokens)
        for layer in model[0].decoder.layers.values():
            layer.mlp.experts.grouped_gemm = False
    assert (loop - expected).abs().max().item() <= 1e-4 and (grouped - expected).abs().max().item() <= 1e-4
    out = tmp_path / "out"
    bridge.save_hf_pretrained(model, out)
    original, exported = tensors(src), tensors(out)
    assert sorted(original) == sorted(exported)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    assert read_config(out) == read_config(src)
    prompt = prompt_ids(VOCAB, 12)
    assert greedy_ours(model, VOCAB, prompt, 8) == greedy_hf(hf, prompt, 8)


def test_lora_targets_every_projection(gemma4):
    """Megatron's targets: one ``linear_qkv`` adapter over what each layer has (q, k and v; q and k on layers
    whose keys are their values; q alone on KV-shared layers), ``linear_proj``, ``linear_fc1``, ``linear_fc2``."""
    _, _, bridge, _ = gemma4
    model = bridge.to_megatron_model()[0]
    LoRA(target_modules=["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]).apply(model)
    adapted = {n.split(".adapter")[0] for n, p in model.named_parameters() if p.requires_grad}
    attention = "decoder.layers.{}.self_attention.{}"
    assert {attention.format(0, m) for m in ("linear_q", "linear_k", "linear_v", "linear_proj")} <= adapted
    assert attention.format(1, "linear_k") in adapted and attention.format(3, "linear_q") in adapted
    assert "decoder.layers.5.mlp.linear_fc2" in adapted and "decoder.layers.5.mlp.linear_fc1_gate" in adapted
    loss = model(_tokens(), labels=_tokens(seed=1)).mean()
    loss.backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if p.requires_grad)


def test_text_tower_of_the_vision_language_model(tmp_path):
    src, out = tmp_path / "hf", tmp_path / "out"
    torch.manual_seed(1)
    cfg = transformers.Gemma4Config(text_config=dict(TEXT, num_hidden_layers=2, layer_types=KINDS[:2],
                                                     num_kv_shared_layers=0), vision_config=None, audio_config=None)
    hf = transformers.Gemma4ForConditionalGeneration(cfg)
    _randomize(hf)
    hf = hf.float().eval()
    hf.save_pretrained(str(src))
    bridge = AutoBridge.from_hf_pretrained(src)
    model = bridge.to_megatron_model()
    tokens = _tokens(seed=2)
    with torch.no_grad():
        diff = (model[0].eval()(tokens) - hf(input_ids=tokens).logits).abs().max().item()
    assert diff <= 1e-4, diff
    bridge.save_hf_pretrained(model, out)
    assert read_config(out)["architectures"] == ["Gemma4ForCausalLM"]
    original = tensors(src)
    for name, tensor in tensors(out).items():
        assert torch.equal(original[name.replace("model.", "model.language_model.", 1)], tensor), name
    # through a longspan checkpoint, which records the family it was imported as (the text tower)
    ckpt, again = tmp_path / "ckpt", tmp_path / "again"
    assert main(["convert", "import", "--hf-model", str(src), "--output", str(ckpt), "--no-progress"]) == 0
    assert main(["convert", "export", "--checkpoint", str(ckpt), "--output", str(again), "--no-progress"]) == 0
    exported = tensors(out)
    assert sorted(tensors(again)) == sorted(exported)
    assert all(torch.equal(exported[name], tensor) for name, tensor in tensors(again).items())


def test_bad_inputs_are_refused_in_one_line(gemma4, gemma4_moe, tmp_path, capsys):
    _, src, bridge, _ = gemma4
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    (bad / "config.json").write_text(json.dumps(dict(read_config(src), num_kv_shared_layers=6)))
    capsys.readouterr()
    assert main(["convert", "import", "--hf-model", str(bad), "--output", str(tmp_path / "ckpt"),
                 "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.num_kv_shared_layers=6 with num_layers=6" in err[0], err
    moe = gemma4_moe[2].to_megatron_provider(load_weights=False)
    moe.moe_layer_freq = 2
    with pytest.raises(NotSupportedError, match=r"model\.moe_layer_freq=2: Gemma 4's MoE block is on every layer"):
        moe.provide_meta()
    with pytest.raises(ConfigError, match="config.json has no 'num_experts'"):  # required with enable_moe_block
        families.family_for_config(read_config(src)).to_provider(dict(read_config(src), enable_moe_block=True))
    provider = bridge.to_megatron_provider(load_weights=False)
    provider.num_global_query_groups, provider.tensor_model_parallel_size = 3, 2
    with pytest.raises(ConfigError, match=r"model\.num_global_query_groups=3 with tensor_model_parallel_size=2"):
        provider.provide_meta()


@pytest.mark.slow
def test_launched_tensor_parallel_import_then_export_round_trips(tmp_path, pool2):
    """Two workers: the import and the export with the heads of both layer kinds, the dense MLP and the experts'
    width split over two ranks (the MoE model)."""
    src, ckpt, out = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "out"
    save_gemma4(src, num_global_key_value_heads=2, **MOE)
    layout = "model.tensor_model_parallel_size=2"
    assert pool2.run(main, ["convert", "import", "--hf-model", str(src), "--output", str(ckpt), "--no-progress",
                            layout], timeout=240) == [0, 0]
    assert pool2.run(main, ["convert", "export", "--checkpoint", str(ckpt), "--output", str(out), "--no-progress",
                            layout], timeout=240) == [0, 0]
    original, exported = tensors(src), tensors(out)
    assert sorted(original) == sorted(exported) and all(torch.equal(exported[k], v) for k, v in original.items())
    assert read_config(out) == read_config(src)


def test_gemma4_recipe_is_the_real_e4b():
    """The recipe's model is google/gemma-4-E4B's text model: its parameter count is transformers' count for that
    config.json's values (7,463,013,376, tied embeddings once) and AutoBridge derives the same fields from them."""
    from longspan.families.gemma4.recipes import gemma4
    from longspan.models.gpt import num_parameters

    cfg = gemma4()
    cfg.validate()
    assert num_parameters(cfg.model.provide_meta()) == 7_463_013_376
    real = transformers.Gemma4TextConfig(
        vocab_size=262_144, hidden_size=2560, intermediate_size=10_240, num_hidden_layers=42, num_attention_heads=8,
        num_key_value_heads=2, head_dim=256, global_head_dim=512, sliding_window=512, num_kv_shared_layers=18,
        hidden_size_per_layer_input=256, vocab_size_per_layer_input=262_144, final_logit_softcapping=30.0)
    real.architectures = ["Gemma4ForCausalLM"]
    from_hf = AutoBridge.from_hf_config(real).to_megatron_provider(load_weights=False)
    for field in ("num_layers", "hidden_size", "ffn_hidden_size", "num_query_groups", "kv_channels",
                  "global_kv_channels", "num_global_query_groups", "window_size", "rotary_base",
                  "global_rotary_percent", "num_kv_shared_layers", "per_layer_embed_dim", "softmax_scale",
                  "final_logit_softcapping", "per_layer_embed_vocab_size", "share_embeddings_and_output_weights"):
        assert getattr(cfg.model, field) == getattr(from_hf, field), field


def test_gemma4_moe_lora_recipe_is_the_real_26b_a4b():
    """``longspan plan --recipe gemma4-moe-lora``'s first line: google/gemma-4-26B-A4B's text model, whose count is
    transformers' for its config.json values (25,233,141,760, tied embeddings once; 3,822,530,560 active per
    token), and AutoBridge derives the recipe's fields from them."""
    from longspan.planner.plan import summary_line
    from longspan.recipes import get_recipe

    cfg = get_recipe("gemma4-moe-lora")
    cfg.validate(world_size=8)
    line = summary_line(cfg)
    assert line.startswith("model: 25,233,141,760 parameters (3,822,530,560 active per token)"), line
    real = transformers.Gemma4TextConfig(
        vocab_size=262_144, hidden_size=2816, intermediate_size=2112, num_hidden_layers=30, num_attention_heads=16,
        num_key_value_heads=8, num_global_key_value_heads=2, head_dim=256, global_head_dim=512, attention_k_eq_v=True,
        sliding_window=1024, num_kv_shared_layers=0, hidden_size_per_layer_input=0, enable_moe_block=True,
        num_experts=128, top_k_experts=8, moe_intermediate_size=704, final_logit_softcapping=30.0)
    real.architectures = ["Gemma4ForCausalLM"]
    from_hf = AutoBridge.from_hf_config(real).to_megatron_provider(load_weights=False)
    for field in ("num_layers", "hidden_size", "ffn_hidden_size", "num_query_groups", "kv_channels",
                  "global_kv_channels", "num_global_query_groups", "attention_k_eq_v", "window_size", "rotary_base",
                  "global_rotary_percent", "num_kv_shared_layers", "per_layer_embed_dim", "num_moe_experts",
                  "moe_router_topk", "moe_ffn_hidden_size", "moe_router_pre_softmax", "final_logit_softcapping",
                  "share_embeddings_and_output_weights"):
        assert getattr(cfg.model, field) == getattr(from_hf, field), field


def test_plan_of_the_gemma4_recipe_runs(capsys):
    """``longspan plan`` probes one- and two-layer models of each layer kind: E4B's 18 KV-sharing layers must
    not make those probes invalid, and a layout with pipeline stages is planned too."""
    from longspan.cli import main

    assert main(["plan", "--recipe", "gemma4", "--world-size", "8", "--device", "h100"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[4:] if line.strip()]
    assert rows and any(r[1] == "2" for r in rows)  # a pp=2 row
