"""GLM-4.7-Flash (``Glm4MoeLiteForCausalLM``) through AutoBridge, on one tiny random model made with
transformers' Glm4MoeLiteConfig: multi-latent attention with query compression, GLM's sigmoid-routed MoE over
two expert groups with random non-zero routing biases and a shared expert, MoE layers where ``mlp_layer_types``
says (not a dense prefix: sparse, dense, sparse), GLM-4.7-Flash's ``rms_norm_eps`` of 1e-5 beside transformers'
fixed 1e-6 of the latent norms, and one multi-token-prediction layer added to the safetensors (transformers
writes none).

Checked: the provider's fields; logits equal transformers' (fp32, <= 1e-5) on a 40-token prompt (no sliding
window here); import -> export bit-identical (tensor names, dtypes, the MTP layer, config.json);
greedy generation with the KV cache token for token; a launched TP2 import -> export bit-identical; LoRA on
the MLA projections; bad ``mlp_layer_types`` / ``first_k_dense_replace`` exit 2 with one line."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from longspan import AutoBridge
from longspan.cli import main
from longspan.conversion import families
from longspan.core.errors import NotSupportedError
from longspan.models.mla import MLASelfAttention
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
from tests.conversion.test_mtp_conversion import add_mtp_layer

VOCAB = 96
ARCH = "Glm4MoeLiteForCausalLM"
SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=12,
             qk_rope_head_dim=8, v_head_dim=10, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
             n_group=2, topk_group=1, routed_scaling_factor=1.8, norm_topk_prob=True, rms_norm_eps=1e-5,
             mlp_layer_types=["sparse", "dense", "sparse"], num_nextn_predict_layers=1, max_position_embeddings=64,
             initializer_range=0.1, tie_word_embeddings=False, attention_dropout=0.0, eos_token_id=1, pad_token_id=2,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
MLA_TARGETS = ["linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj", "linear_proj"]
HF_MLA_NAMES = {"linear_q_down_proj": "q_a_proj", "linear_q_up_proj": "q_b_proj",
                "linear_kv_down_proj": "kv_a_proj_with_mqa", "linear_kv_up_proj": "kv_b_proj", "linear_proj": "o_proj"}


def make_glm_lite(directory, seed: int = 0):
    """Save a random fp32 GLM-4.7-Flash to ``directory`` (norms around 1, spread routers, non-zero routing biases)
    with one MTP layer added to its safetensors; returns the transformers model."""
    torch.manual_seed(seed)
    model = transformers.Glm4MoeLiteForCausalLM(transformers.Glm4MoeLiteConfig(**SHAPE))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("gate.weight"):  # routers: spread the scores so ties never happen
                p.normal_(0, 1.0)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.uniform_(-0.5, 0.5)
    model = model.float().eval()
    model.save_pretrained(str(directory))
    add_mtp_layer(directory)
    return model


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    src = tmp_path_factory.mktemp("glm_lite") / "hf"
    hf = make_glm_lite(src)
    bridge = AutoBridge.from_hf_pretrained(src)
    return src, hf, bridge, bridge.to_megatron_model()


def _tokens(n: int = 40, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, n), generator=torch.Generator().manual_seed(seed))


def test_provider_fields_and_latent_norm_epsilon(imported):
    _, _, bridge, model = imported
    p = bridge.to_megatron_provider(load_weights=False)
    assert p.multi_latent_attention and (p.q_lora_rank, p.kv_lora_rank, p.qk_head_dim) == (24, 16, 12)
    assert p.moe_layer_freq == [1, 0, 1] and p.num_moe_experts == 8 and p.moe_shared_expert_intermediate_size == 16
    assert (p.moe_router_num_groups, p.moe_router_group_topk) == (2, 1) and p.moe_router_topk_scaling_factor == 1.8
    assert (p.mtp_num_layers, p.mtp_loss_scaling_factor) == (1, 0.3)
    assert p.layernorm_epsilon == 1e-5 and p.mla_latent_layernorm_epsilon == 1e-6
    attention = model[0].decoder.layers["0"].self_attention
    assert isinstance(attention, MLASelfAttention)
    assert attention.q_layernorm.eps == attention.kv_layernorm.eps == 1e-6
    assert model[0].decoder.layers["0"].input_layernorm.eps == 1e-5
    names = {n for n, _ in model[0].named_parameters()}
    assert "decoder.layers.1.mlp.linear_fc1_gate.weight" in names  # the dense middle layer
    assert "decoder.layers.0.mlp.experts.linear_fc1.weight" in names and "mtp.layers.0.eh_proj.weight" in names


def test_logits_equal_transformers_and_export_is_bit_identical(imported, tmp_path):
    src, hf, bridge, model = imported
    tokens = _tokens()
    reference = hf_logits(hf, tokens)
    with torch.no_grad():
        ours = model[0].eval()(tokens)
    diff = (ours - reference).abs().max().item()
    # 1e-5, tighter than the 1e-4: latent norms at rms_norm_eps instead of 1e-6 differ by ~8e-5 here
    assert diff <= 1e-5, diff

    out = tmp_path / "out"
    assert_export_round_trips(bridge, model, src, out, tokens)  # the MTP layer's tensors included
    assert "model.layers.3.eh_proj.weight" in tensors(out)
    assert read_config(out) == read_config(src)
    regenerated = families.hf_config_dict(families.by_architecture()[ARCH], bridge.to_megatron_provider(False))
    source = read_config(src)
    assert regenerated["mlp_layer_types"] == SHAPE["mlp_layer_types"] and "first_k_dense_replace" not in regenerated
    for key, value in regenerated.items():
        assert key in source, key
        assert source[key] == value or source[key] == pytest.approx(value), key


def test_greedy_generate_with_the_cache_equals_transformers(imported):
    src, _, _, model = imported
    prompt = prompt_ids(VOCAB, 24)
    expected = greedy_hf(load_hf(src), prompt, 12)
    assert greedy_ours(model, VOCAB, prompt, 12) == expected and len(expected) == 12


def test_lora_targets_reach_the_mla_projections(imported):
    """Megatron's MLA names adapt every layer's projections (the MTP depth's too) and name HF's modules."""
    src, _, bridge, _ = imported
    model = AutoBridge.from_hf_pretrained(src).to_megatron_model()[0]
    LoRA(target_modules=MLA_TARGETS, dim=4, alpha=8).apply(model)
    adapted = {n for n, m in model.named_modules() if isinstance(m, LoRALinear)}
    expected = {f"{prefix}.self_attention.{t}" for prefix in ("decoder.layers.0", "decoder.layers.1",
                                                              "decoder.layers.2", "mtp.layers.0.transformer_layer")
                for t in MLA_TARGETS}
    assert adapted == expected
    for target, hf_name in HF_MLA_NAMES.items():
        ours = f"decoder.layers.2.self_attention.{target}"
        assert bridge.hf_module_name(ours) == f"model.layers.2.self_attn.{hf_name}"


# zai-org/GLM-4.7-Flash's config.json (its values as published): no mlp_layer_types, first_k_dense_replace 1,
# top-level rope_theta and partial_rotary_factor, one MTP layer.
PUBLISHED = dict(architectures=[ARCH], model_type="glm4_moe_lite", vocab_size=154880, hidden_size=2048,
                 intermediate_size=10240, moe_intermediate_size=1536, num_hidden_layers=47, num_attention_heads=20,
                 num_key_value_heads=20, hidden_act="silu", rms_norm_eps=1e-5, attention_bias=False,
                 max_position_embeddings=202752, rope_theta=1000000, rope_scaling=None, partial_rotary_factor=1.0,
                 q_lora_rank=768, kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256,
                 n_routed_experts=64, n_shared_experts=1, num_experts_per_tok=4, norm_topk_prob=True,
                 routed_scaling_factor=1.8, n_group=1, topk_group=1, first_k_dense_replace=1,
                 num_nextn_predict_layers=1, topk_method="noaux_tc", tie_word_embeddings=False, dtype="bfloat16")


def test_the_published_config_translates():
    p = AutoBridge.from_hf_config(PUBLISHED).to_megatron_provider(load_weights=False)
    assert p.moe_layer_freq == [0] + [1] * 46 and p.mtp_num_layers == 1 and p.rotary_base == 1000000
    assert (p.layernorm_epsilon, p.mla_latent_layernorm_epsilon, p.params_dtype) == (1e-5, 1e-6, torch.bfloat16)
    assert (p.num_moe_experts, p.moe_router_topk, p.moe_shared_expert_intermediate_size) == (64, 4, 1536)
    assert p.moe_router_num_groups is None and p.v_head_dim == 256


def test_export_writes_mlp_layer_types_from_either_form_and_refuses_another_latent_epsilon(imported):
    family = families.by_architecture()[ARCH]
    provider = imported[2].to_megatron_provider(load_weights=False)
    provider.moe_layer_freq = 2  # every second layer from layer 0: the imported [1, 0, 1]
    assert families.hf_config_dict(family, provider)["mlp_layer_types"] == SHAPE["mlp_layer_types"]
    provider.mla_latent_layernorm_epsilon = None  # the latents at layernorm_epsilon (1e-5): transformers has 1e-6
    with pytest.raises(NotSupportedError, match="mla_latent_layernorm_epsilon=None") as info:
        families.hf_config_dict(family, provider)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("change, message", [
    ({"mlp_layer_types": ["sparse", "moe", "sparse"]}, "config.json mlp_layer_types=['sparse', 'moe', 'sparse'] must "
                                                       "list 3 entries"),
    ({"mlp_layer_types": None, "first_k_dense_replace": 2}, "config.json first_k_dense_replace=2 without "
                                                            "mlp_layer_types"),
])
def test_bad_mlp_layer_types_exit_2_in_one_line(imported, tmp_path, capsys, change, message):
    src = tmp_path / "hf"
    src.mkdir()
    cfg = {k: v for k, v in dict(read_config(imported[0]), **change).items() if v is not None}
    (src / "config.json").write_text(json.dumps(cfg))
    (src / "model.safetensors").symlink_to(imported[0] / "model.safetensors")
    capsys.readouterr()
    assert main(["convert", "import", "--hf-model", str(src), "--output", str(tmp_path / "c"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err, err


@pytest.mark.slow
def test_launched_tensor_parallel_import_then_export_round_trips(imported, tmp_path, pool2):
    """Two workers: import and export with the heads (and the MTP depth's) split over two ranks."""
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
