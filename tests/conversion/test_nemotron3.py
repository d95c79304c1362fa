"""Nemotron 3 (``NemotronHForCausalLM`` with MoE layers): one tiny random model made with transformers'
NemotronHConfig (layers M, E, *, -, E, M: Mamba-2, MoE, attention, MLP; uneven shapes; non-trivial norms, a
nonzero routing bias, a router spread so top-k never ties) has transformers' logits in longspan, exports
bit-identically (also from a launched tensor-parallel layout), generates greedily as transformers does with the
cache, and refuses in one line what longspan cannot build.

The MoE layers carry every Nemotron 3 feature: 6 squared-ReLU experts of width 24 in a latent space of 20
(``moe_latent_size``; hidden 36), top 2 of the best 1 of 3 expert groups, sigmoid scores chosen with the bias,
normalized and scaled by 2.5, and a shared expert of width 28.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers

from longspan import AutoBridge
from longspan.config.rules.model import check_mamba_model
from longspan.core.errors import ConfigError, NotSupportedError
from longspan.data.tokenizers import build_tokenizer
from longspan.inference import generate
from longspan.training.config import TokenizerConfig
from tests.conversion.hf_models import VOCAB, hf_logits, make_tokenizer, read_config
from tests.conversion.parity import tensors

TYPES = ["linear_attention", "moe", "full_attention", "mlp", "moe", "linear_attention"]
SHAPE = dict(vocab_size=VOCAB, hidden_size=36, layers_block_type=TYPES, num_attention_heads=6, num_key_value_heads=2,
             head_dim=8, intermediate_size=40, mamba_num_heads=6, mamba_head_dim=8, ssm_state_size=8, n_groups=2,
             chunk_size=8, conv_kernel=4, n_routed_experts=6, num_experts_per_tok=2, moe_intermediate_size=24,
             moe_shared_expert_intermediate_size=28, moe_latent_size=20, n_group=3, topk_group=1,
             routed_scaling_factor=2.5, tie_word_embeddings=False, eos_token_id=1, pad_token_id=2, bos_token_id=0)
PROMPT = "def hello(world): return world + 1 the quick"
NEW_TOKENS = 10


def make_nemotron3(directory, seed: int = 0, **overrides) -> transformers.NemotronHForCausalLM:
    """Save a random fp32 Nemotron 3 to ``directory`` (with a tokenizer) and return it."""
    torch.manual_seed(seed)
    model = transformers.NemotronHForCausalLM(transformers.NemotronHConfig(**dict(SHAPE, **overrides)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("gate.weight"):
                p.normal_(0, 1.0)
            else:
                p.add_(torch.randn_like(p) * 0.05)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.uniform_(-0.3, 0.3)
    model = model.float().eval()
    model.save_pretrained(str(directory))
    make_tokenizer(directory)
    return model


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """(transformers' model, its directory, the bridge, longspan's model) of the module's one tiny model."""
    src = tmp_path_factory.mktemp("nemotron3") / "hf"
    hf = make_nemotron3(src)
    bridge = AutoBridge.from_hf_pretrained(src)
    (model,) = bridge.to_megatron_model()
    return hf, src, bridge, model.eval()


def _tokens(n: int = 23, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, n), generator=torch.Generator().manual_seed(seed))


def test_logits_equal_transformers(imported):
    hf, _, bridge, model = imported
    provider = bridge.to_megatron_provider(load_weights=False)
    assert provider.hybrid_override_pattern == "ME*-EM" and provider.moe_latent_size == 20
    assert (provider.moe_router_num_groups, provider.moe_router_group_topk) == (3, 1)
    assert provider.moe_router_topk_scaling_factor == 2.5 and provider.moe_shared_expert_intermediate_size == 28
    tokens = _tokens()
    want = hf_logits(hf, tokens)
    with torch.no_grad():
        assert (model(tokens) - want).abs().max().item() <= 1e-4
        # each routing feature matters at this tolerance: without the group limit or the bias, other experts win
        router = model.decoder.layers["1"].mlp.router
        moe = router.moe
        router.moe = dataclasses.replace(moe, num_groups=None, group_topk=None)
        assert (model(tokens) - want).abs().max().item() > 1e-3
        router.moe = moe
        bias = router.expert_bias.clone()
        router.expert_bias.zero_()
        assert (model(tokens) - want).abs().max().item() > 1e-3
        router.expert_bias.copy_(bias)


def test_export_is_bit_identical(imported, tmp_path):
    _, src, bridge, model = imported
    out = tmp_path / "out"
    bridge.save_hf_pretrained([model], out)
    original, exported = tensors(src), tensors(out)
    assert sorted(original) == sorted(exported)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    assert any(".fc1_latent_proj." in k for k in original) and any(".experts.5.up_proj" in k for k in original)
    before, after = read_config(src), read_config(out)
    assert after == before


def test_greedy_generate_with_the_cache_equals_transformers(imported):
    hf, src, _, model = imported
    tokenizer = build_tokenizer(TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(src)))
    prompt_ids = tokenizer.tokenize(PROMPT)
    ids = torch.tensor([prompt_ids])
    hf.config._attn_implementation = "eager"
    expected = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS,
                           eos_token_id=None, pad_token_id=2)[0, len(prompt_ids):].tolist()
    result = generate([model], tokenizer, PROMPT, max_new_tokens=NEW_TOKENS, eos_ids=())
    assert result.output_ids == expected and len(expected) == NEW_TOKENS


def test_multi_token_prediction_is_refused_in_one_line(tmp_path):
    src = tmp_path / "hf"
    make_nemotron3(src, num_nextn_predict_layers=1)
    with pytest.raises(NotSupportedError) as error:
        AutoBridge.from_hf_pretrained(src).to_megatron_provider(load_weights=False)
    assert "num_nextn_predict_layers=1 is not supported yet" in str(error.value) and "\n" not in str(error.value)


def test_a_latent_size_tensor_parallel_cannot_split_is_a_one_line_error(imported):
    provider = imported[2].to_megatron_provider(load_weights=False)
    provider.tensor_model_parallel_size, provider.moe_latent_size = 2, 21
    with pytest.raises(ConfigError) as error:
        check_mamba_model(provider)
    message = str(error.value)
    assert "model.moe_latent_size=21 is not divisible by model.tensor_model_parallel_size=2" in message
    assert "\n" not in message


@pytest.mark.slow
def test_launched_tensor_parallel_import_then_export_round_trips(imported, tmp_path, pool2):
    """Two workers: the import and the export with the Mamba and attention heads, the MLP, the shared expert,
    the experts' width and the latent projections split over two ranks."""
    from longspan.cli import main

    src, ckpt, out = imported[1], tmp_path / "ckpt", tmp_path / "out"
    layout = "model.tensor_model_parallel_size=2"
    assert pool2.run(main, ["convert", "import", "--hf-model", str(src), "--output", str(ckpt), "--no-progress",
                            layout], timeout=240) == [0, 0]
    assert pool2.run(main, ["convert", "export", "--checkpoint", str(ckpt), "--output", str(out), "--no-progress",
                            layout], timeout=240) == [0, 0]
    original, exported = tensors(src), tensors(out)
    assert sorted(original) == sorted(exported) and all(torch.equal(exported[k], v) for k, v in original.items())
    assert read_config(out) == read_config(src)


@pytest.mark.parametrize("recipe", ["nemotron3-nano", "nemotron3-nano-lora"])
def test_nemotron3_nano_recipe_plans_the_published_parameter_count(recipe):
    """``longspan plan --recipe nemotron3-nano``'s first line (and its LoRA finetune's): the published 31.6B total
    (31,577,937,344 from the released config.json, see the recipe's docstring) and 3.6B active parameters, with
    embeddings."""
    from longspan.planner.plan import summary_line
    from longspan.recipes import get_recipe

    line = summary_line(get_recipe(recipe))
    assert line.startswith("model: 31,577,937,344 parameters (3,580,073,408 active per token)"), line


def test_lora_targets_reach_the_moe_and_mamba_layers(imported):
    """Bridge's Nemotron LoRA targets (the recipe's) adapt the routed experts, the shared expert, attention, the
    MLP and the Mamba mixers."""
    from longspan.families.nemotron.recipes import NEMOTRON_LORA_TARGETS
    from longspan.peft import LoRA
    from longspan.peft.adapters import plan_adapters

    plan = plan_adapters(imported[3], LoRA(target_modules=list(NEMOTRON_LORA_TARGETS)))
    assert plan["decoder.layers.0.mixer.in_proj"] == [f"decoder.layers.0.mixer.in_proj.{s}" for s in
                                                      ("z", "x", "B", "C", "dt")]
    assert plan["decoder.layers.0.mixer.out_proj"] == ["decoder.layers.0.mixer.out_proj"]
    for layer in ("1", "4"):
        for module in ("experts.linear_fc1", "experts.linear_fc2", "shared_experts.linear_fc1",
                       "shared_experts.linear_fc2"):
            assert f"decoder.layers.{layer}.mlp.{module}" in plan, module
    assert "decoder.layers.2.self_attention.linear_qkv" in plan and "decoder.layers.3.mlp.linear_fc1" in plan
    assert not any("latent_proj" in name for names in plan.values() for name in names)
