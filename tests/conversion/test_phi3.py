"""Phi-3 / Phi-4 (``Phi3ForCausalLM``): fused qkv_proj / gate_up_proj split on import and fused on export,
LongRoPE (Phi-3's 'su'), partial rotary (Phi-4-mini), a sliding window on every layer, tied embeddings."""

from __future__ import annotations

import pytest
import torch
import transformers

from longspan import AutoBridge
from longspan.core.errors import NotSupportedError
from tests.conversion.parity import (
    assert_export_round_trips,
    greedy_hf,
    greedy_ours,
    hf_logits,
    load_hf,
    ours_logits,
    prompt_ids,
    save_random_model,
)

VOCAB, ORIGINAL, WINDOW = 96, 32, 12
PROMPT, NEW = 24, 20  # longer than the window; prompt + generated crosses original_max_position_embeddings
ROT_PAIRS = 6  # head_dim 16 * partial_rotary_factor 0.75 / 2

VARIANTS = {
    # Phi-4-mini-like: LongRoPE, partial rotary, tied embeddings, grouped-query attention, sliding window
    "longrope": dict(
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                         "short_factor": [1.0 + 0.2 * i for i in range(ROT_PAIRS)],
                         "long_factor": [1.0 + 2.0 * i for i in range(ROT_PAIRS)]},
        original_max_position_embeddings=ORIGINAL, max_position_embeddings=128, tie_word_embeddings=True,
        sliding_window=WINDOW,
    ),
    # Phi-3-mini-4k-like: default RoPE, no window, untied
    "default": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                    original_max_position_embeddings=64, max_position_embeddings=64, tie_word_embeddings=False),
}


def phi3_config(variant: str) -> transformers.Phi3Config:
    return transformers.Phi3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, initializer_range=0.15, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, **VARIANTS[variant],
    )


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def imported(request, tmp_path_factory):
    variant = request.param
    src = tmp_path_factory.mktemp(variant) / "hf"
    save_random_model(phi3_config(variant), src)
    bridge = AutoBridge.from_hf_pretrained(src)
    return variant, src, bridge, bridge.to_megatron_model()


def test_provider_fields(imported):
    variant, _, bridge, _ = imported
    p = bridge.to_megatron_provider(load_weights=False)
    assert (p.num_attention_heads, p.num_query_groups, p.kv_channels) == (4, 2, 16)
    if variant == "longrope":
        assert p.rotary_percent == 0.75 and p.rope_original_max_position_embeddings == ORIGINAL
        assert len(p.rope_longrope_long_factor) == ROT_PAIRS and p.share_embeddings_and_output_weights
        assert p.window_size == [WINDOW - 1, 0] and p.window_attn_skip_freq is None
        # transformers' default attention factor for max_position_embeddings / original = 4
        assert p.rope_attention_factor == pytest.approx((1 + torch.log(torch.tensor(4.0)).item()
                                                         / torch.log(torch.tensor(float(ORIGINAL))).item()) ** 0.5)
    else:
        assert p.window_size is None and p.rope_longrope_short_factor is None


@pytest.mark.parametrize("length", [ORIGINAL - 8, ORIGINAL + 16])
def test_logits_equal_transformers(imported, length):
    variant, src, _, model = imported
    tokens = torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(length))
    diff = (ours_logits(model[0], tokens) - hf_logits(load_hf(src), tokens)).abs().max().item()
    assert diff <= 1e-5, (variant, length, diff)


def test_export_fuses_back_bit_identical(imported, tmp_path):
    variant, src, bridge, model = imported
    tokens = torch.randint(0, VOCAB, (2, ORIGINAL + 4), generator=torch.Generator().manual_seed(1))
    assert_export_round_trips(bridge, model, src, tmp_path / "out", tokens)


def test_greedy_generation_equals_transformers(imported):
    """transformers' Phi-3 re-encodes its cache when LongRoPE switches to the long factors; so does longspan."""
    variant, src, _, model = imported
    prompt = prompt_ids(VOCAB, PROMPT)
    expected = greedy_hf(load_hf(src), prompt, NEW)
    assert greedy_ours(model[0], VOCAB, prompt, NEW) == expected
    assert greedy_ours(model[0], VOCAB, prompt, NEW, use_cache=False) == expected
    assert len(set(expected)) > 3


def test_su_alias_and_unsupported_rope_type():
    cfg = phi3_config("longrope").to_dict()
    cfg["rope_scaling"] = dict(cfg.pop("rope_parameters"), type="su")
    cfg["rope_scaling"].pop("rope_type")
    provider = AutoBridge.from_hf_config(cfg).to_megatron_provider(load_weights=False)
    assert provider.rope_longrope_short_factor == VARIANTS["longrope"]["rope_parameters"]["short_factor"]
    cfg["rope_scaling"] = {"rope_type": "dynamic", "factor": 2.0}
    with pytest.raises(NotSupportedError, match="'dynamic' is not supported for Phi-3"):
        AutoBridge.from_hf_config(cfg).to_megatron_provider(load_weights=False)
