"""Adapters exported in HF PEFT format load with ``peft.PeftModel.from_pretrained`` onto the transformers base
and give longspan's logits (<= 1e-5): LoRA with Megatron's shared-A qkv / gate-up, CanonicalLoRA, DoRA."""

from __future__ import annotations

import json

import peft as hf_peft
import pytest
import torch
import transformers

from longspan.conversion import AutoBridge
from longspan.core.errors import NotSupportedError
from longspan.peft import CanonicalLoRA, DoRA, LoRA
from longspan.peft.adapters import init_adapters, init_dora_magnitudes
from longspan.peft.hf_export import ADAPTER_CONFIG, ADAPTER_WEIGHTS, save_hf_peft_adapter
from tests.conversion.hf_models import hf_logits, make_hf_model
from tests.helpers.adapters import perturb_adapters


def _tokens(vocab: int = 90, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 10), generator=torch.Generator().manual_seed(seed))


def _export_adapted(config, tmp_path) -> tuple[torch.Tensor, torch.Tensor]:
    """The HF model in ``tmp_path/hf`` imported, ``config``'s adapters applied as after training, their logits on
    test tokens, and the adapters written in HF PEFT format to ``tmp_path/adapter``; returns (logits, tokens)."""
    bridge = AutoBridge.from_hf_pretrained(tmp_path / "hf")
    model = bridge.to_megatron_model()[0]
    config.apply(model)
    init_adapters([model], seed=5)
    init_dora_magnitudes([model])
    perturb_adapters(model, std=0.05, seed=3)
    model.eval()
    tokens = _tokens()
    with torch.no_grad():
        ours = model(tokens)
    save_hf_peft_adapter(model, config, bridge, tmp_path / "adapter", base_model_name_or_path=str(tmp_path / "hf"))
    return ours, tokens


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("config", [LoRA(dim=4, alpha=8), CanonicalLoRA(dim=4, alpha=16), DoRA(dim=4, alpha=8),
                                    LoRA(dim=2, alpha=4, target_modules=["*.layers.1.*.linear_qkv", "linear_fc2"])],
                         ids=["lora", "canonical", "dora", "lora_wildcard"])
def test_peft_loads_the_export_and_matches_longspan(family, config, tmp_path) -> None:
    hf = make_hf_model(family, tmp_path / "hf")
    ours, tokens = _export_adapted(config, tmp_path)
    saved = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())
    assert saved["use_dora"] == (config.kind == "dora") and saved["r"] == config.dim
    assert (tmp_path / "adapter" / ADAPTER_WEIGHTS).is_file()

    peft_model = hf_peft.PeftModel.from_pretrained(hf, str(tmp_path / "adapter")).eval()
    theirs = hf_logits(peft_model, tokens)
    assert (ours - theirs).abs().max().item() <= 1e-5
    assert (theirs - hf_logits(transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")), tokens)
            ).abs().max().item() > 1e-3  # the adapters change the outputs
    if config.kind == "lora" and "*.layers.1.*.linear_qkv" not in config.target_modules:
        layer = peft_model.base_model.model.model.layers[0].self_attn
        a_q, a_k = layer.q_proj.lora_A["default"].weight, layer.k_proj.lora_A["default"].weight
        assert torch.equal(a_q, a_k)  # one shared A, copied per HF module


def test_fused_hf_modules_cannot_take_adapters(tmp_path) -> None:
    make_hf_model("gpt2", tmp_path / "hf")
    bridge = AutoBridge.from_hf_pretrained(tmp_path / "hf")
    model = bridge.to_megatron_model()[0]
    LoRA(dim=2).apply(model)
    with pytest.raises(NotSupportedError, match="one-to-one Hugging Face module"):
        save_hf_peft_adapter(model, LoRA(dim=2), bridge, tmp_path / "adapter")


def _phi3(directory) -> None:
    from tests.conversion.parity import save_random_model
    from tests.conversion.test_phi3 import phi3_config

    save_random_model(phi3_config("default"), directory)


FUSED = {  # family: (make the HF model, adapter targets, the target of an HF module fusing row blocks of ours)
    "nemotron_h": (lambda d: make_hf_model("nemotron_h", d),
                   ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "in_proj"],  # peft refuses out_proj
                   "layers.0.mixer.in_proj"),
    "phi3": (_phi3, ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"], "layers.0.self_attn.qkv_proj"),
}


@pytest.mark.parametrize("family", sorted(FUSED))
@pytest.mark.parametrize("config", [LoRA(dim=4, alpha=8), DoRA(dim=4, alpha=8)], ids=["lora", "dora"])
def test_modules_hf_fuses_take_the_shared_adapter(family, config, tmp_path) -> None:
    """A Mamba mixer's ``in_proj`` segments (Nemotron-H) and Phi-3's ``qkv_proj`` / ``gate_up_proj`` blocks are
    separate layers here under one shared A; HF's fused module takes that A and their B stacked by rows."""
    make, targets, fused = FUSED[family]
    make(tmp_path / "hf")
    config.target_modules = list(targets)
    ours, tokens = _export_adapted(config, tmp_path)
    assert fused in json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())["target_modules"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    base = hf_logits(hf, tokens)
    theirs = hf_logits(hf_peft.PeftModel.from_pretrained(hf, str(tmp_path / "adapter")).eval(), tokens)
    assert (ours - theirs).abs().max().item() <= 1e-5
    assert (theirs - base).abs().max().item() > 1e-3  # the adapters change the outputs


def test_fused_hf_modules_need_one_shared_adapter_over_all_blocks(tmp_path) -> None:
    """And a Mamba mixer's out_proj, which peft refuses, is refused before anything is written."""
    make_hf_model("nemotron_h", tmp_path / "hf")
    bridge = AutoBridge.from_hf_pretrained(tmp_path / "hf")
    for config, words in [(CanonicalLoRA(dim=2, target_modules=["in_proj_z", "in_proj_x", "in_proj_B", "in_proj_C",
                                                                  "in_proj_dt"]), "its own A"),
                          (CanonicalLoRA(dim=2, target_modules=["in_proj_x"]), "only 1 are adapted"),
                          (LoRA(dim=2, target_modules=["in_proj", "out_proj"]), "peft refuses adapters on a Mamba")]:
        model = bridge.to_megatron_model()[0]
        config.apply(model)
        with pytest.raises(NotSupportedError, match=words):
            save_hf_peft_adapter(model, config, bridge, tmp_path / "adapter")
