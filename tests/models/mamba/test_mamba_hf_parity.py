"""Mamba-2 through AutoBridge against transformers' Mamba2ForCausalLM torch path (independent oracle)."""

from __future__ import annotations

import json

import pytest
import safetensors.torch
import torch
import transformers

from longspan.conversion import AutoBridge, families
from longspan.core.errors import NotSupportedError
from longspan.models import MambaProvider
from longspan.models.mamba import MambaModel
from tests.models.mamba.mamba_test_config import hybrid_config, mamba_config


def _hf_mamba2(tmp_path, **overrides):
    values = dict(num_heads=8, head_dim=8, vocab_size=100, hidden_size=32, state_size=8, num_hidden_layers=3,
                  n_groups=2, expand=2, chunk_size=8, conv_kernel=4)
    values.update(overrides)
    torch.manual_seed(0)
    model = transformers.Mamba2ForCausalLM(transformers.Mamba2Config(**values)).eval()
    with torch.no_grad():  # HF initializes norms, D and biases to constants: make every tensor distinct
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    path = tmp_path / "hf"
    model.save_pretrained(path)
    return model, path


def _tensors(directory) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(safetensors.torch.load_file(str(f)))
    return out


@pytest.mark.parametrize("length", [1, 19, 32])
def test_logits_equal_transformers_and_export_is_bit_exact(tmp_path, length):
    hf, path = _hf_mamba2(tmp_path)
    bridge = AutoBridge.from_hf_pretrained(path)
    provider = bridge.to_megatron_provider()
    assert isinstance(provider, MambaProvider)
    assert (provider.mamba_num_heads, provider.mamba_head_dim, provider.mamba_num_groups) == (8, 8, 2)
    (model,) = bridge.to_megatron_model()
    assert isinstance(model, MambaModel)
    model.eval()
    ids = torch.randint(0, 100, (2, length), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, 100, (2, length), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = hf(ids).logits
        got = model(ids)
        loss = model(ids, labels=labels)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= 1e-5
    want_loss = torch.nn.functional.cross_entropy(want.flatten(0, 1), labels.flatten(), reduction="none")
    assert (loss.flatten() - want_loss).abs().max().item() <= 1e-5

    out = tmp_path / "out"
    bridge.save_hf_pretrained([model], out)
    original, exported = _tensors(path), _tensors(out)
    assert sorted(original) == sorted(exported)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    again = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    with torch.no_grad():
        assert torch.equal(again(ids).logits, want)
    # every key the provider -> config translation writes round-trips
    cfg = json.loads((path / "config.json").read_text())
    for key, value in families.hf_config_dict(bridge.family, provider).items():
        if key in cfg and key != "dtype":
            assert cfg[key] == value, key


def test_longspan_mamba_exports_as_mamba2_and_loads_in_transformers(tmp_path):
    provider = mamba_config(num_layers=2, mamba_num_heads=8, mamba_head_dim=8, vocab_size=96)
    model = provider.provide()
    model.eval()
    bridge = AutoBridge.from_longspan_provider(provider)
    assert bridge.family.architecture == "Mamba2ForCausalLM"
    bridge.save_hf_pretrained([model], tmp_path / "out")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    ids = torch.randint(0, 96, (2, 21), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert (hf(ids).logits - model(ids)).abs().max().item() <= 1e-5


def test_hybrid_does_not_export_as_mamba2():
    with pytest.raises(NotSupportedError, match="Mamba layers only"):
        families.hf_config_dict(families.by_architecture()["Mamba2ForCausalLM"], hybrid_config())


@pytest.mark.parametrize("overrides,match", [
    (dict(window_size=[3, 0]), "no sliding window"),
    (dict(apply_residual_connection_post_layernorm=True), "apply_residual_connection_post_layernorm"),
])
def test_hybrid_fields_nemotron_h_cannot_hold_refuse_to_export(overrides, match):
    with pytest.raises(NotSupportedError, match=match):
        families.hf_config_dict(families.by_architecture()["NemotronHForCausalLM"], hybrid_config(**overrides))


@pytest.mark.parametrize("overrides,match", [
    (dict(use_conv_bias=False), "use_conv_bias=False"),
    (dict(time_step_limit=(0.01, 1.0)), "time_step_limit"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
])
def test_unsupported_mamba2_configs_are_one_line_errors(tmp_path, overrides, match):
    _, path = _hf_mamba2(tmp_path, **overrides)
    with pytest.raises(NotSupportedError, match=match):
        AutoBridge.from_hf_pretrained(path).to_megatron_provider()


# ------------------------------------------------------------------------------------------- Nemotron-H (hybrid)

def _hf_nemotron_h(tmp_path, types=("linear_attention", "full_attention", "linear_attention", "mlp"), **overrides):
    values = dict(vocab_size=100, hidden_size=32, layers_block_type=list(types), num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, intermediate_size=48, mamba_num_heads=8, mamba_head_dim=8,
                  ssm_state_size=8, n_groups=2, chunk_size=8, conv_kernel=4)
    values.update(overrides)
    torch.manual_seed(0)
    model = transformers.NemotronHForCausalLM(transformers.NemotronHConfig(**values)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    path = tmp_path / "hf_nemotron_h"
    model.save_pretrained(path)
    return model, path


def test_nemotron_h_logits_equal_transformers_and_export_is_bit_exact(tmp_path):
    hf, path = _hf_nemotron_h(tmp_path, time_step_min=0.05)  # a high floor: the clamp is active on many heads
    bridge = AutoBridge.from_hf_pretrained(path)
    provider = bridge.to_megatron_provider()
    assert provider.hybrid_override_pattern == "M*M-" and provider.mamba_dt_limit_min == pytest.approx(0.05)
    (model,) = bridge.to_megatron_model()
    model.eval()
    ids = torch.randint(0, 100, (2, 23), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids).logits
        got = model(ids)
        assert (got - want).abs().max().item() <= 1e-5
        # the Mamba layers matter at this tolerance, and so does the dt clamp transformers applies
        for key in ("0", "2"):
            model.decoder.layers[key].mixer.dt_limit_min = 0.0
        assert (model(ids) - want).abs().max().item() > 2e-5  # fails the 1e-5 parity above
        for key in ("0", "2"):
            model.decoder.layers[key].mixer.dt_limit_min = 0.05
    out = tmp_path / "out"
    bridge.save_hf_pretrained([model], out)
    original, exported = _tensors(path), _tensors(out)
    assert sorted(original) == sorted(exported)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    again = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    with torch.no_grad():
        assert torch.equal(again(ids).logits, want)


def test_tiny_hybrid_exports_as_nemotron_h_and_loads_in_transformers(tmp_path):
    from longspan.recipes import get_recipe

    provider = get_recipe("tiny-hybrid").model
    provider.hidden_size, provider.mamba_num_heads, provider.mamba_head_dim, provider.ffn_hidden_size = 32, 4, 16, 64
    provider.num_attention_heads, provider.num_query_groups, provider.vocab_size = 4, 2, 96
    provider.make_vocab_size_divisible_by = 32
    provider.finalize()
    model = provider.provide().eval()
    bridge = AutoBridge.from_longspan_provider(provider)
    assert bridge.family.architecture == "NemotronHForCausalLM"
    bridge.save_hf_pretrained([model], tmp_path / "out")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    ids = torch.randint(0, 96, (2, 21), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert (hf(ids).logits - model(ids)).abs().max().item() <= 1e-5
