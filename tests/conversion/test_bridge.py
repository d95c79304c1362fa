"""AutoBridge on one process: every family's logits equal transformers', and import -> export is lossless."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors import safe_open

from longspan import AutoBridge
from longspan.conversion import families, is_hf_model_dir
from longspan.core.errors import CheckpointError, NotSupportedError
from tests.conversion.hf_models import FAMILIES, VOCAB, hf_logits, make_hf_model, read_config


def _tensors(directory) -> dict[str, torch.Tensor]:
    out = {}
    files = sorted(p for p in directory.iterdir() if p.suffix == ".safetensors")
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                out[k] = fh.get_tensor(k)
    return out


def _tokens(n=12, seed=0):
    return torch.randint(0, VOCAB, (2, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", FAMILIES)
def test_import_matches_transformers_and_export_is_bit_identical(family, tmp_path):
    src, out = tmp_path / "hf", tmp_path / "out"
    hf = make_hf_model(family, src, max_shard_size="20KB" if family in ("llama", "mixtral") else None)
    bridge = AutoBridge.from_hf_pretrained(src)
    model = bridge.to_megatron_model()
    assert len(model) == 1
    tokens = _tokens()
    with torch.no_grad():
        ours = model[0].eval()(tokens)
    assert ours.shape[-1] == VOCAB  # no padding rows (vocab divisor chosen from the HF vocab)
    assert (ours - hf_logits(hf, tokens)).abs().max().item() <= 1e-5

    bridge.save_hf_pretrained(model, out)
    original, exported = _tensors(src), _tensors(out)
    assert sorted(original) == sorted(exported)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    assert read_config(out)["architectures"] == read_config(src)["architectures"]
    assert (out / "tokenizer.json").is_file()
    # The provider <-> config translation round-trips every key it writes.
    cfg = read_config(src)
    regenerated = families.hf_config_dict(bridge.family, bridge.to_megatron_provider())
    for key, value in regenerated.items():
        if cfg.get(key) is not None:  # null = the derived default
            assert cfg[key] == value or (isinstance(value, float) and cfg[key] == pytest.approx(value)), key
    # transformers loads the export and computes the same logits.
    again = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    assert torch.equal(hf_logits(again, tokens), hf_logits(hf, tokens))


def test_bf16_stays_bf16(tmp_path):
    src, out = tmp_path / "hf", tmp_path / "out"
    make_hf_model("qwen2", src, dtype=torch.bfloat16)
    bridge = AutoBridge.from_hf_pretrained(src)
    provider = bridge.to_megatron_provider()
    assert provider.params_dtype == torch.bfloat16
    import copy

    assert copy.deepcopy(provider).provide_distributed_model.provider is not provider
    model = provider.provide_distributed_model(wrap_with_ddp=False)
    assert all(p.dtype == torch.bfloat16 for p in model[0].parameters())
    bridge.save_hf_pretrained(model, out)
    original, exported = _tensors(src), _tensors(out)
    assert all(exported[k].dtype == torch.bfloat16 and torch.equal(exported[k], v) for k, v in original.items())
    assert read_config(out)["dtype"] == "bfloat16"


def test_vocab_padding_added_on_import_and_stripped_on_export(tmp_path):
    src, out = tmp_path / "hf", tmp_path / "out"
    hf = make_hf_model("llama", src)
    bridge = AutoBridge.from_hf_pretrained(src)
    provider = bridge.to_megatron_provider()
    provider.make_vocab_size_divisible_by = 128
    model = bridge.to_megatron_model(provider=provider)
    emb = model[0].embedding.word_embeddings.weight
    assert emb.shape[0] == 128 and torch.equal(emb[VOCAB:], torch.zeros_like(emb[VOCAB:]))
    tokens = _tokens()
    with torch.no_grad():
        ours = model[0].eval()(tokens)
    assert (ours[..., :VOCAB] - hf_logits(hf, tokens)).abs().max().item() <= 1e-5
    bridge.save_hf_pretrained(model, out)
    assert all(torch.equal(_tensors(out)[k], v) for k, v in _tensors(src).items())


def test_tied_embeddings_stay_tied(tmp_path):
    src, out = tmp_path / "hf", tmp_path / "out"
    make_hf_model("qwen3", src)  # tie_word_embeddings=True
    bridge = AutoBridge.from_hf_pretrained(src)
    model = bridge.to_megatron_model()
    assert model[0].output_layer is None
    names = [name for name, _ in bridge.export_hf_weights(model)]
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names


def test_longspan_model_exports_as_llama(tmp_path):
    """A model that never came from HF (the tiny recipe's shape) exports as Llama that transformers runs."""
    from longspan.models.gpt import build_gpt_model
    from longspan.recipes.tiny import tiny

    provider = tiny().model
    provider.num_layers, provider.hidden_size, provider.ffn_hidden_size, provider.vocab_size = 2, 32, 64, 256
    provider.finalize()
    model = build_gpt_model(provider, seed=3).eval()
    bridge = AutoBridge.from_longspan_provider(provider)
    assert bridge.family.architecture == "LlamaForCausalLM"
    bridge.save_hf_pretrained([model], tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path))
    tokens = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (model(tokens) - hf_logits(hf, tokens)).abs().max().item() <= 1e-5


def test_supported_models_and_unsupported_architecture(tmp_path):
    assert "LlamaForCausalLM" in AutoBridge.list_supported_models()
    assert "Qwen3MoeForCausalLM" in AutoBridge.list_supported_models()
    assert AutoBridge.supports(transformers.LlamaConfig(architectures=["LlamaForCausalLM"]))
    assert not AutoBridge.supports({"architectures": ["BertForMaskedLM"]})
    with pytest.raises(NotSupportedError, match="BertForMaskedLM is not supported.*LlamaForCausalLM"):
        AutoBridge.from_hf_config({"architectures": ["BertForMaskedLM"]})
    with pytest.raises(CheckpointError, match="does not exist"):
        AutoBridge.from_hf_pretrained(tmp_path / "missing")


def test_from_hf_config_builds_provider_fields():
    cfg = transformers.Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                                      num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
                                      moe_intermediate_size=16, decoder_sparse_step=2, norm_topk_prob=True)
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    p = AutoBridge.from_hf_config(cfg).to_megatron_provider(load_weights=False)
    assert (p.num_moe_experts, p.moe_router_topk, p.moe_ffn_hidden_size) == (8, 2, 16)
    assert p.moe_layer_freq == [0, 1, 0, 1] and p.moe_router_pre_softmax is False and p.qk_layernorm


def test_hf_module_name_and_is_hf_model_dir(tmp_path):
    make_hf_model("llama", tmp_path / "a", tokenizer=False)
    make_hf_model("gpt2", tmp_path / "b", tokenizer=False)
    assert is_hf_model_dir(tmp_path / "a") and not is_hf_model_dir(tmp_path)
    llama = AutoBridge.from_hf_pretrained(tmp_path / "a")
    assert llama.hf_module_name("decoder.layers.3.self_attention.linear_q") == "model.layers.3.self_attn.q_proj"
    assert llama.hf_module_name("decoder.layers.0.mlp.linear_fc1_gate") == "model.layers.0.mlp.gate_proj"
    assert llama.hf_module_name("output_layer") == "lm_head"
    assert llama.hf_module_name("decoder.layers.0.nothing") is None
    gpt2 = AutoBridge.from_hf_pretrained(tmp_path / "b")
    assert gpt2.hf_module_name("decoder.layers.0.self_attention.linear_q") is None  # fused c_attn


def test_shape_mismatch_and_truncated_file(tmp_path):
    src = tmp_path / "hf"
    make_hf_model("llama", src, tokenizer=False)
    cfg = read_config(src)
    cfg["intermediate_size"] = 40
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"model.layers.0.mlp.up_proj.weight has shape \(48, 32\).*\(40, 32\)"):
        AutoBridge.from_hf_pretrained(src).to_megatron_model()
    cfg["intermediate_size"] = 48
    (src / "config.json").write_text(json.dumps(cfg))
    f = src / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="model.safetensors is truncated"):
        AutoBridge.from_hf_pretrained(src).to_megatron_model()


def test_base_model_names_without_prefix_load(tmp_path):
    """Checkpoints saved from the base model (the hub's gpt2: ``h.0.attn...``, ``wte.weight``) load too."""
    from safetensors.torch import save_file

    src = tmp_path / "hf"
    hf = make_hf_model("gpt2", src, tokenizer=False)
    tensors = _tensors(src)
    save_file({k.split(".", 1)[1]: v for k, v in tensors.items()}, str(src / "model.safetensors"))
    model = AutoBridge.from_hf_pretrained(src).to_megatron_model()
    tokens = _tokens()
    with torch.no_grad():
        assert (model[0].eval()(tokens) - hf_logits(hf, tokens)).abs().max().item() <= 1e-5
