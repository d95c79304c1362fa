"""LoRA / DoRA / CanonicalLoRA on a gated DeltaNet hybrid (one process): the DeltaNet projections go by
Megatron's ``in_proj`` (one shared A over q/k/v/z/b/a) and ``out_proj``, the attention's output gate joins
``linear_qkv``; the adapters reach the mixer's forward (which computes with local tensors), train, and fold into
the merged weights exactly."""

from __future__ import annotations

import pytest
import torch

from longspan.core.errors import ConfigError
from longspan.models.gated_delta_net import GatedDeltaNet
from longspan.models.gpt import build_gpt_model, init_weights
from longspan.peft import CanonicalLoRA, DoRA, LoRA
from longspan.peft.adapters import init_adapters, init_dora_magnitudes, plan_adapters
from longspan.peft.modules import DoRALinear, LoRALinear
from tests.helpers.adapters import assert_adapters_act_and_fold, trained_parameters
from tests.models.gpt_test_config import llama_config

SEED = 5
# layers 0, 2: gated DeltaNet; 1, 3: gated full attention (QK-norm, partial rotary, output gate)
HYBRID = dict(num_layers=4, experimental_attention_variant="gated_delta_net", linear_attention_freq=2,
              linear_conv_kernel_dim=3, linear_key_head_dim=8, linear_value_head_dim=6, linear_num_key_heads=2,
              linear_num_value_heads=4, attention_output_gate=True, qk_layernorm=True, rotary_percent=0.5,
              layernorm_zero_centered_gamma=True)
ALL = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "in_proj", "out_proj"]


def _model(peft=None, seed: int = SEED):
    model = build_gpt_model(llama_config(**HYBRID), materialize=False)
    if peft is not None:
        peft.apply(model)
    init_weights(model, seed=seed)
    if peft is not None:
        init_adapters([model], seed)
        init_dora_magnitudes([model])
    return model


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(seed))


def test_megatron_names_of_the_deltanet_and_gate_projections() -> None:
    model = build_gpt_model(llama_config(**HYBRID), materialize=False)
    groups = plan_adapters(model, LoRA(target_modules=ALL))
    mixer = "decoder.layers.0.self_attention"
    assert groups[f"{mixer}.in_proj"] == [f"{mixer}.linear_{s}" for s in "qkvzba"]
    assert groups[f"{mixer}.out_proj"] == [f"{mixer}.linear_proj"]
    attn = "decoder.layers.1.self_attention"
    assert sorted(groups[f"{attn}.linear_qkv"]) == sorted(f"{attn}.linear_{s}" for s in ("q", "k", "v", "gate"))
    assert groups[f"{attn}.linear_proj"] == [f"{attn}.linear_proj"]
    # Megatron's attention names leave the DeltaNet layers alone, and the other way round
    attention_only = plan_adapters(model, LoRA())
    assert not any(".layers.0.self_attention" in g or ".layers.2.self_attention" in g for g in attention_only)
    deltanet_only = plan_adapters(model, LoRA(target_modules=["in_proj", "out_proj"]))
    assert sorted(deltanet_only) == sorted(f"decoder.layers.{i}.self_attention.{p}" for i in (0, 2)
                                           for p in ("in_proj", "out_proj"))
    canonical = plan_adapters(model, CanonicalLoRA(target_modules=["in_proj_z", "out_proj", "linear_gate"]))
    assert sorted(canonical) == sorted([f"{mixer}.in_proj_z", f"{mixer}.out_proj", f"{attn}.linear_gate",
                                        "decoder.layers.2.self_attention.in_proj_z",
                                        "decoder.layers.2.self_attention.out_proj",
                                        "decoder.layers.3.self_attention.linear_gate"])
    # Bridge's CanonicalLoRA takes the fused in_proj whole (one shared A), as LoRA does
    assert plan_adapters(model, CanonicalLoRA(target_modules=["in_proj"]))[f"{mixer}.in_proj"] == \
        [f"{mixer}.linear_{s}" for s in "qkvzba"]
    with pytest.raises(ConfigError, match="in_proj"):
        plan_adapters(model, LoRA(target_modules=["in_proj_qkv"]))


@pytest.mark.parametrize("peft", [LoRA(dim=4, alpha=8), DoRA(dim=4, alpha=8), CanonicalLoRA(dim=4, alpha=8)],
                         ids=lambda p: type(p).__name__)
def test_deltanet_adapters_act_and_fold_into_the_merged_weights(peft) -> None:
    if peft.kind == "canonical":
        peft.target_modules = ["linear_q", "linear_k", "linear_v", "linear_gate", "linear_proj", "in_proj_q",
                               "in_proj_k", "in_proj_v", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"]
    else:
        peft.target_modules = list(ALL)
    ids = _ids()
    base = _model().eval()
    model = _model(peft).eval()
    mixer = model.decoder.layers["0"].self_attention
    assert isinstance(mixer, GatedDeltaNet)
    wrapper = DoRALinear if peft.kind == "dora" else LoRALinear
    for name in ("linear_q", "linear_k", "linear_v", "linear_z", "linear_b", "linear_a", "linear_proj"):
        assert isinstance(getattr(mixer, name), wrapper)
    assert isinstance(model.decoder.layers["1"].self_attention.linear_gate, wrapper)
    assert_adapters_act_and_fold(model, base, _model().eval(), ids,
                                 [getattr(mixer, name) for name in ("linear_z", "linear_a", "linear_proj")])


def test_only_the_deltanet_adapters_train_and_get_gradients() -> None:
    model = _model(LoRA(dim=4, alpha=8, target_modules=["in_proj", "out_proj"]))
    trainable = trained_parameters(model, _ids(1))
    assert all(".adapter." in n and ".self_attention." in n for n in trainable)
    # one A for the six input projections of a mixer, a B each
    assert sum(".layers.0.self_attention.linear_" in n and "linear_in" in n for n in trainable) == 2
    assert sum(".layers.0.self_attention.linear_" in n and "linear_out" in n for n in trainable) == 7
