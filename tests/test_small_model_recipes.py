"""The gemma3 / llama32 / llama32_3b recipes: their models are the real ones (parameter counts, and the same
fields AutoBridge derives from the real config.json), they validate, and ``plan`` sizes them."""

from __future__ import annotations

import pytest
import transformers

from longspan import AutoBridge
from longspan.models.gpt import num_parameters
from longspan.planner.plan import plan
from longspan.recipes import get_recipe

# Parameter counts of google/gemma-3-1b-pt, meta-llama/Llama-3.2-1B and Llama-3.2-3B (tied embeddings counted once)
REAL_PARAMETERS = {"gemma3": 999_885_952, "llama32": 1_235_814_400, "llama32_3b": 3_212_749_824}

ARCHITECTURE_FIELDS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
    "softmax_scale", "vocab_size", "normalization", "layernorm_epsilon", "layernorm_zero_centered_gamma",
    "layernorm_before_sublayers", "layernorm_after_sublayers", "qk_layernorm", "apply_embedding_scaling",
    "gated_linear_unit", "activation_func", "add_bias_linear", "rotary_base", "rope_scaling", "window_size",
    "share_embeddings_and_output_weights", "attn_logit_softcapping", "final_logit_softcapping",
)


def _real_config(name: str) -> transformers.PretrainedConfig:
    if name == "gemma3":
        cfg = transformers.Gemma3TextConfig(
            vocab_size=262_144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
            num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=512,
            max_position_embeddings=32_768, rope_scaling=None, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
        )
        cfg.architectures = ["Gemma3ForCausalLM"]
        return cfg
    rope = {"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    shape = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, head_dim=64) if name == "llama32" \
        else dict(hidden_size=3072, num_hidden_layers=28, num_attention_heads=24, head_dim=128)
    cfg = transformers.LlamaConfig(vocab_size=128_256, intermediate_size=8192, num_key_value_heads=8,
                                   max_position_embeddings=131_072, rms_norm_eps=1e-5, tie_word_embeddings=True,
                                   rope_parameters=rope, **shape)
    cfg.architectures = ["LlamaForCausalLM"]
    return cfg


@pytest.mark.parametrize("name", sorted(REAL_PARAMETERS))
def test_recipe_model_is_the_real_model(name):
    cfg = get_recipe(name)
    cfg.validate()
    assert cfg.peft is not None and cfg.mixed_precision == "bf16_mixed"
    model = cfg.model
    assert num_parameters(model.provide_meta()) == REAL_PARAMETERS[name]
    from_hf = AutoBridge.from_hf_config(_real_config(name)).to_megatron_provider(load_weights=False)
    for field in ARCHITECTURE_FIELDS:
        ours, theirs = getattr(model, field, None), getattr(from_hf, field, None)
        assert ours == theirs or (isinstance(ours, list) and list(ours) == list(theirs)), (field, ours, theirs)
    if name == "gemma3":
        assert model.window_attn_skip_freq == 6 and from_hf.window_attn_skip_freq == [1, 1, 1, 1, 1, 0] * 4 + [1, 1]
        assert from_hf.rope_scaling_factor == model.rope_scaling_factor == 1.0


def test_plan_sizes_gemma3_on_eight_h100s():
    rows, _rejected = plan(get_recipe("gemma3"), 8, "h100")
    assert rows and all(row.memory.peak > 2 * 999_885_952 / 2**30 for row in rows)  # at least the bf16 weights
