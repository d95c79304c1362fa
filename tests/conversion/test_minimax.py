"""MiniMax-M2 (``MiniMaxM2ForCausalLM``): one tiny random model made with transformers' MiniMaxM2Config (8 experts
top 2 with a non-zero expert bias, QK-norm across 6 heads in 2 KV groups, RoPE on half of each head, non-trivial
norms) has transformers' logits in longspan, exports bit-identically (also from a launched TP2 layout), generates
greedily as transformers does with the cache, takes LoRA on its projections and experts, reads the hub's
config.json spelling, and refuses what it cannot compute in one line."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers

from longspan import AutoBridge
from longspan.cli import main
from longspan.conversion import families
from longspan.core.errors import NotSupportedError
from longspan.families.minimax.hf import minimax_m2_provider
from longspan.peft import LoRA
from longspan.peft.adapters import init_adapters
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
# Uneven: 6 heads of width 8 over 2 KV groups (the q norm spans 48 channels, the k norm 16), RoPE on 4 of 8
# channels (rotary_dim), 8 experts of width 20, top 2; 3 layers.
SHAPE = dict(vocab_size=VOCAB, hidden_size=24, intermediate_size=20, num_hidden_layers=3, num_attention_heads=6,
             num_key_value_heads=2, head_dim=8, rotary_dim=4, num_local_experts=8, num_experts_per_tok=2,
             max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=0,
             eos_token_id=1, pad_token_id=2)


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """(directory, model): a random fp32 MiniMax-M2 saved once for the module (eager attention)."""
    directory = tmp_path_factory.mktemp("minimax") / "hf"
    torch.manual_seed(0)
    model = transformers.MiniMaxM2ForCausalLM(transformers.MiniMaxM2Config(**SHAPE))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.empty(p.shape).uniform_(0.5, 1.5, generator=g))
            elif name.endswith("gate.weight"):  # routers spread, so the top 2 never tie
                p.copy_(torch.randn(p.shape, generator=g))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # the choice differs from the unbiased scores'
                buffer.copy_(torch.empty(buffer.shape).uniform_(-0.3, 0.3, generator=g))
    model = model.float().eval()
    model.save_pretrained(str(directory))
    model.config._attn_implementation = "eager"
    return directory, model


def _tokens(n: int = 40, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, n), generator=torch.Generator().manual_seed(seed))


def test_logits_equal_transformers_and_export_is_bit_identical(tmp_path, hf_model):
    src, hf = hf_model
    bridge = AutoBridge.from_hf_pretrained(src)
    provider = bridge.to_megatron_provider(load_weights=False)
    assert provider.qk_layernorm and provider.qk_layernorm_across_heads and provider.rotary_percent == 0.5
    assert provider.moe_router_score_function == "sigmoid" and provider.moe_router_enable_expert_bias
    assert (provider.num_moe_experts, provider.moe_router_topk, provider.moe_ffn_hidden_size) == (8, 2, 20)
    model = bridge.to_megatron_model()
    bias = model[0].decoder.layers["1"].mlp.router.expert_bias
    assert torch.equal(bias, hf.model.layers[1].mlp.e_score_correction_bias)
    tokens = _tokens()
    with torch.no_grad():
        diff = (model[0].eval()(tokens) - hf_logits(hf, tokens)).abs().max().item()
    assert diff <= 1e-4, diff

    assert_export_round_trips(bridge, model, src, tmp_path / "out", tokens)
    source = read_config(src)
    regenerated = families.hf_config_dict(bridge.family, provider)
    for key, value in regenerated.items():
        if key in source and key not in ("dtype", "rope_parameters"):
            assert source[key] == value or source[key] == pytest.approx(value), key


def test_a_model_exported_by_architecture_loads_in_transformers(tmp_path, hf_model):
    """The provider's own config.json (with the hub's spellings) makes transformers compute the same logits."""
    src, hf = hf_model
    bridge = AutoBridge.from_hf_pretrained(src)
    model = bridge.to_megatron_model()
    provider = bridge.to_megatron_provider(load_weights=False)
    out = tmp_path / "out"
    AutoBridge.from_longspan_provider(provider, "MiniMaxM2ForCausalLM").save_hf_pretrained(model, out)
    written = read_config(out)
    assert written["rotary_dim"] == 4 and written["scoring_func"] == "sigmoid" and written["use_routing_bias"]
    again = transformers.AutoModelForCausalLM.from_pretrained(str(out), attn_implementation="eager").float().eval()
    assert type(again).__name__ == "MiniMaxM2ForCausalLM" and sorted(tensors(out)) == sorted(tensors(src))
    tokens = _tokens(seed=1)
    with torch.no_grad():
        assert (model[0].eval()(tokens) - hf_logits(again, tokens)).abs().max().item() <= 1e-4


def test_greedy_generate_with_the_cache_equals_transformers(hf_model):
    src, hf = hf_model
    prompt = prompt_ids(VOCAB, 24)
    expected = greedy_hf(hf, prompt, 10, use_cache=True)
    model = AutoBridge.from_hf_pretrained(src).to_megatron_model()
    assert greedy_ours(model, VOCAB, prompt, 10, use_cache=True) == expected


def test_lora_targets_the_projections_and_every_expert(hf_model):
    """Megatron's target names reach q/k/v, the output projection and the experts' slabs; zero B: same logits."""
    src, _ = hf_model
    model = AutoBridge.from_hf_pretrained(src).to_megatron_model()[0].eval()
    tokens = _tokens(seed=2)
    with torch.no_grad():
        before = model(tokens)
    LoRA(dim=2, target_modules=["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]).apply(model)
    init_adapters([model], seed=1)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    layer = "decoder.layers.2."
    for module in ("self_attention.linear_q", "self_attention.linear_k", "self_attention.linear_v",
                   "self_attention.linear_proj", "mlp.experts.linear_fc1", "mlp.experts.linear_fc2"):
        assert any(name.startswith(layer + module + ".adapter") for name in trainable), module
    assert not any("layernorm" in name or "router" in name for name in trainable)
    with torch.no_grad():
        assert torch.equal(model(tokens), before)


# The published config.json's spelling (MiniMaxAI/MiniMax-M2): rope_theta and rotary_dim at the top level, the
# fixed choices spelled out, the multi-token-prediction keys (modules neither transformers nor the files have).
HUB = dict(SHAPE, rope_theta=5_000_000, scoring_func="sigmoid", use_routing_bias=True, use_qk_norm=True,
           qk_norm_type="per_layer", shared_intermediate_size=0, attn_type_list=[1, 1, 1], use_mtp=True,
           num_mtp_modules=3, mtp_transformer_layers=1, sliding_window=None, model_type="minimax_m2")


def test_the_hub_spelling_reads_as_transformers_reads_it(hf_model):
    src, _ = hf_model
    assert minimax_m2_provider(HUB) == minimax_m2_provider(read_config(src))


@pytest.mark.parametrize("change,message", [
    (dict(scoring_func="softmax"), "scoring_func='softmax' is not supported: MiniMax-M2 needs scoring_func='sigmoid'"),
    (dict(qk_norm_type="per_head"), "qk_norm_type='per_head' is not supported"),
    (dict(rotary_dim=4, partial_rotary_factor=0.25), "rotary_dim=4 (of head_dim 8) contradicts partial_rotary_factor"),
    (dict(num_experts_per_tok=1), "num_experts_per_tok=1 is not supported"),
    (dict(attn_type_list=[0, 1, 1]), "attn_type_list has linear-attention layers"),
])
def test_what_longspan_cannot_compute_is_refused_in_one_line(change, message):
    with pytest.raises(NotSupportedError, match="^config.json " + message.replace("(", r"\(").replace(")", r"\)")):
        minimax_m2_provider(dict(HUB, **change))


def test_the_cli_import_names_the_field_and_exits_2(tmp_path, hf_model, capsys):
    src, _ = hf_model
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    cfg = read_config(bad)
    (bad / "config.json").write_text(json.dumps(dict(cfg, scoring_func="softmax")))
    assert main(["convert", "import", "--hf-model", str(bad), "--output", str(tmp_path / "ckpt"),
                 "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "scoring_func='softmax'" in err[0], err


@pytest.mark.slow
def test_launched_tensor_parallel_import_then_export_round_trips(tmp_path, pool2, hf_model):
    """Two workers: the import and the export with the heads (and the whole-projection q / k norms' weights)
    split over two ranks."""
    src, _ = hf_model
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    layout = "model.tensor_model_parallel_size=2"
    assert pool2.run(main, ["convert", "import", "--hf-model", str(src), "--output", str(ckpt), "--no-progress",
                            layout], timeout=240) == [0, 0]
    assert pool2.run(main, ["convert", "export", "--checkpoint", str(ckpt), "--output", str(out), "--no-progress",
                            layout], timeout=240) == [0, 0]
    original, exported = tensors(src), tensors(out)
    assert sorted(original) == sorted(exported) and all(torch.equal(exported[k], v) for k, v in original.items())
    assert read_config(out)["architectures"] == ["MiniMaxM2ForCausalLM"]


# MiniMaxAI/MiniMax-M2's published config.json (the values transformers' MiniMaxM2Config defaults repeat, with the
# hub's rotary_dim): 230B parameters, 10B active per token (its model card).
PUBLISHED = dict(HUB, vocab_size=200_064, hidden_size=3072, intermediate_size=1536, num_hidden_layers=62,
                 num_attention_heads=48, num_key_value_heads=8, head_dim=128, rotary_dim=64, num_local_experts=256,
                 num_experts_per_tok=8, max_position_embeddings=196_608, router_aux_loss_coef=0.001,
                 attn_type_list=[1] * 62, bos_token_id=200_034, eos_token_id=200_020, pad_token_id=None)


def test_the_recipe_is_the_published_model_and_plans_its_parameter_count():
    from longspan.planner import plan as planner
    from longspan.recipes import get_recipe

    cfg = get_recipe("minimax-m2")
    imported = minimax_m2_provider(PUBLISHED)
    for field in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
                  "vocab_size", "rotary_base", "rotary_percent", "layernorm_epsilon", "qk_layernorm_across_heads",
                  "num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_router_score_function",
                  "moe_router_enable_expert_bias", "share_embeddings_and_output_weights"):
        assert getattr(cfg.model, field) == imported[field], field
    cfg.model.finalize()
    meta = cfg.model.provide_meta()
    counts = planner.model_parameter_counts(cfg, meta)
    h, q, kv, ffn, experts, vocab = 3072, 48 * 128, 8 * 128, 1536, 256, 200_064
    attention = h * q * 2 + h * kv * 2 + q + kv  # q, o, k, v and the whole-projection q / k norms
    layer = attention + 2 * h + experts * h + experts * 3 * h * ffn  # two norms, router, experts (the bias: a buffer)
    total = 62 * layer + 2 * vocab * h + h  # untied embedding and output layer, final norm
    assert counts["total"] == total == 228_689_748_992  # "230B"
    active = total - 62 * (experts - 8) * 3 * h * ffn
    assert counts["active"] == active and round((active - 2 * vocab * h) / 1e9, 1) == 9.8  # "10B active"
    assert planner.summary_line(cfg, meta).startswith("model: 228,689,748,992 parameters (11,030,537,216 active")
