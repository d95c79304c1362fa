"""The qwen35 / qwen36-moe-lora / qwen3-next recipes have the published models' shapes: the parameter count of
transformers' model built from the published config.json values (Qwen/Qwen3.5-0.8B's text model,
Qwen/Qwen3.6-35B-A3B's, Qwen/Qwen3-Next-80B-A3B-Instruct; the multi-token-prediction layer and the vision tower
are not part of it), which rounds to the published size, and the fields AutoBridge derives from that config."""

from __future__ import annotations

import pytest
import torch
import transformers

from longspan import AutoBridge
from longspan.models.gpt import num_parameters
from longspan.models.layer_pattern import linear_attention_layer_flags
from longspan.planner.plan import plan
from longspan.recipes import get_recipe

ROPE = {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25}


def _published(name: str) -> transformers.PretrainedConfig:
    """The config.json values of each model (those the config classes' defaults do not already hold)."""
    if name == "qwen35":
        cfg = transformers.Qwen3_5TextConfig(
            hidden_size=1024, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8,
            num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
            tie_word_embeddings=True, rope_parameters=ROPE)
        cfg.architectures = ["Qwen3_5ForCausalLM"]
    elif name == "qwen36-moe-lora":  # Qwen3.5-MoE's architecture: 40 layers, 256 experts, hidden 2048
        cfg = transformers.Qwen3_5MoeTextConfig(tie_word_embeddings=False, rope_parameters=ROPE)
        cfg.architectures = ["Qwen3_5MoeForCausalLM"]
    else:
        cfg = transformers.Qwen3NextConfig(intermediate_size=5120, tie_word_embeddings=False, rope_parameters=ROPE)
        cfg.architectures = ["Qwen3NextForCausalLM"]
    return cfg


# (parameters of transformers' model for the published config, the published size in billions)
PUBLISHED = {"qwen35": (752_393_024, 0.8), "qwen36-moe-lora": (34_660_610_688, 35),
             "qwen3-next": (79_674_391_296, 80)}

#: a world size each recipe's layout fits (experts over 8; Qwen3-Next also pipeline 4)
WORLD = {"qwen35": 1, "qwen36-moe-lora": 8, "qwen3-next": 32}

FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels", "vocab_size",
          "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
          "linear_conv_kernel_dim", "experimental_attention_variant", "attention_output_gate", "qk_layernorm",
          "layernorm_zero_centered_gamma", "layernorm_epsilon", "rotary_base", "rotary_percent",
          "share_embeddings_and_output_weights", "num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size",
          "moe_shared_expert_intermediate_size", "moe_shared_expert_gate", "moe_router_pre_softmax")


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_recipe_model_is_the_published_model(name: str) -> None:
    count, billions = PUBLISHED[name]
    cfg = get_recipe(name)
    cfg.validate(world_size=WORLD[name])
    model = cfg.model
    assert num_parameters(model.provide_meta()) == count
    assert round(count / 1e9, 1 if billions < 1 else 0) == billions
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(_published(name))
    assert sum(p.numel() for p in hf.parameters()) == count
    from_hf = AutoBridge.from_hf_config(_published(name)).to_megatron_provider(load_weights=False)
    for field in FIELDS:
        assert getattr(model, field, None) == getattr(from_hf, field, None), (field, getattr(model, field, None),
                                                                             getattr(from_hf, field, None))
    if model.num_moe_experts is None:
        assert model.ffn_hidden_size == from_hf.ffn_hidden_size
    layers = model.num_layers
    assert linear_attention_layer_flags(model.linear_attention_freq, layers) == \
        linear_attention_layer_flags(from_hf.linear_attention_freq, layers)


def test_plan_sizes_qwen35_on_eight_h100s() -> None:
    rows, _rejected = plan(get_recipe("qwen35"), 8, "h100")
    assert rows and all(row.memory.peak > 2 * PUBLISHED["qwen35"][0] / 8 / 2**30 for row in rows)
