"""Sliding-window families from config.json: Qwen2 (use_sliding_window on the layers from max_window_layers
on) and Ministral (a window on the layers layer_types marks). Logits, export and greedy generation equal
transformers', with prompts longer than the window."""

from __future__ import annotations

import pytest
import torch
import transformers

from longspan import AutoBridge
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

VOCAB, WINDOW, PROMPT, NEW = 96, 8, 24, 16
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.15, attention_dropout=0.0,
              tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def qwen2_config() -> transformers.Qwen2Config:
    # layer 0 full, layers 1 and 2 windowed (transformers: layers >= max_window_layers slide)
    return transformers.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)


def ministral_config() -> transformers.MinistralConfig:
    return transformers.MinistralConfig(
        **COMMON, head_dim=16, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"])


CONFIGS = {"qwen2": (qwen2_config, [None, WINDOW, WINDOW]), "ministral": (ministral_config, [WINDOW, None, WINDOW])}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def imported(request, tmp_path_factory):
    family = request.param
    src = tmp_path_factory.mktemp(family) / "hf"
    save_random_model(CONFIGS[family][0](), src)
    bridge = AutoBridge.from_hf_pretrained(src)
    return family, src, bridge, bridge.to_megatron_model()


def test_layer_windows(imported):
    family, _, _, model = imported
    assert model[0].args.layer_windows == CONFIGS[family][1]


def test_logits_equal_transformers(imported):
    family, src, _, model = imported
    tokens = torch.randint(0, VOCAB, (2, 3 * WINDOW), generator=torch.Generator().manual_seed(0))
    diff = (ours_logits(model[0], tokens) - hf_logits(load_hf(src), tokens)).abs().max().item()
    assert diff <= 1e-5, (family, diff)


def test_export_is_bit_identical_with_equivalent_config(imported, tmp_path):
    family, src, bridge, model = imported
    tokens = torch.randint(0, VOCAB, (2, 3 * WINDOW), generator=torch.Generator().manual_seed(1))
    assert_export_round_trips(bridge, model, src, tmp_path / "out", tokens)


@pytest.mark.parametrize("use_cache", [True, False])
def test_greedy_generation_equals_transformers(imported, use_cache):
    family, src, _, model = imported
    prompt = prompt_ids(VOCAB, PROMPT)
    expected = greedy_hf(load_hf(src), prompt, NEW)
    assert greedy_ours(model[0], VOCAB, prompt, NEW, use_cache=use_cache) == expected
    assert len(set(expected)) > 3


def test_qwen2_without_use_sliding_window_has_no_window():
    cfg = dict(qwen2_config().to_dict(), use_sliding_window=False)
    cfg.pop("layer_types")
    provider = AutoBridge.from_hf_config(cfg).to_megatron_provider(load_weights=False)
    assert provider.window_size is None
