"""Llama with every RoPE scaling transformers defines for it (linear, dynamic, yarn, longrope, llama3):
frequencies equal transformers', logits within 1e-5, export bit-identical with an equivalent config.json,
greedy generation token for token, with sequences crossing original_max_position_embeddings."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from longspan import AutoBridge
from longspan.core.errors import ConfigError, NotSupportedError
from longspan.models.gpt import build_gpt_model
from longspan.models.rope import RotaryEmbedding
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
from tests.models.gpt_test_config import llama_config

VOCAB, ORIGINAL, LONG = 96, 32, 128
PROMPT, NEW = 24, 20  # 44 positions: the scaling's long regime is reached while generating
HALF_ROT = 8  # head_dim 16

SCALINGS = {
    "default": ({"rope_type": "default"}, LONG),
    "linear": ({"rope_type": "linear", "factor": 2.0}, LONG),
    "dynamic": ({"rope_type": "dynamic", "factor": 2.0}, ORIGINAL),  # dynamic scales from max_position_embeddings
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}, LONG),
    "yarn_mscale": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL,
                     "beta_fast": 16.0, "beta_slow": 2.0, "mscale": 0.9, "mscale_all_dim": 0.7, "truncate": False},
                    LONG),
    "longrope": ({"rope_type": "longrope", "original_max_position_embeddings": ORIGINAL,
                  "short_factor": [1.0 + 0.1 * i for i in range(HALF_ROT)],
                  "long_factor": [1.0 + 1.5 * i for i in range(HALF_ROT)]}, LONG),
    "llama3": ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": ORIGINAL}, LONG),
}


def llama_hf_config(kind: str) -> transformers.LlamaConfig:
    rope, max_positions = SCALINGS[kind]
    return transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=max_positions, tie_word_embeddings=False,
        attention_dropout=0.0, initializer_range=0.15, rope_parameters=dict(rope, rope_theta=10000.0),
    )


@pytest.fixture(scope="module", params=sorted(SCALINGS))
def imported(request, tmp_path_factory):
    kind = request.param
    src = tmp_path_factory.mktemp(kind) / "hf"
    save_random_model(llama_hf_config(kind), src)
    bridge = AutoBridge.from_hf_pretrained(src)
    return kind, src, bridge, bridge.to_megatron_model()


def _tokens(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, n), generator=torch.Generator().manual_seed(seed))


def test_frequencies_equal_transformers(imported):
    kind, src, _, model = imported
    config = load_hf(src).config
    rope = model[0].rotary_pos_emb
    for seq_len in (ORIGINAL - 4, ORIGINAL + 12):
        if kind == "default":
            expected, scale = 1.0 / (10000.0 ** (torch.arange(0, 16, 2).float() / 16)), 1.0
        else:
            rope_type = config.rope_parameters["rope_type"]
            expected, scale = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", seq_len=seq_len)
            if rope_type == "dynamic" and seq_len <= ORIGINAL:
                expected = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")[0]
            if rope_type == "dynamic":  # transformers passes the length as a tensor while decoding
                expected = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", seq_len=torch.tensor(seq_len))[0] \
                    if seq_len > ORIGINAL else expected
        assert torch.equal(rope.inv_freq(torch.device("cpu"), seq_len), expected), (kind, seq_len)
        assert rope.attention_scaling == pytest.approx(scale, rel=1e-12), kind


@pytest.mark.parametrize("length", [ORIGINAL - 8, ORIGINAL + 16])
def test_logits_equal_transformers(imported, length):
    kind, src, _, model = imported
    tokens = _tokens(length)
    diff = (ours_logits(model[0], tokens) - hf_logits(load_hf(src), tokens)).abs().max().item()
    assert diff <= 1e-5, (kind, length, diff)


def test_export_is_bit_identical_with_equivalent_config(imported, tmp_path):
    kind, src, bridge, model = imported
    assert_export_round_trips(bridge, model, src, tmp_path / "out", _tokens(ORIGINAL + 8))


def test_greedy_generation_equals_transformers(imported):
    kind, src, _, model = imported
    prompt = prompt_ids(VOCAB, PROMPT)
    ours = greedy_ours(model[0], VOCAB, prompt, NEW)
    if kind == "longrope":
        # transformers' Llama keeps the short-factor keys in its cache after the switch; longspan re-encodes the
        # sequence at the switch (as transformers' Phi-3 does), which is what decoding without a cache computes.
        expected = greedy_hf(load_hf(src), prompt, NEW, use_cache=False)
    else:
        expected = greedy_hf(load_hf(src), prompt, NEW)
    assert ours == expected, kind
    assert len(set(expected)) > 3
    if kind in ("dynamic", "longrope"):  # sequence-dependent: the uncached path too
        assert greedy_ours(model[0], VOCAB, prompt, NEW, use_cache=False) == greedy_hf(
            load_hf(src), prompt, NEW, use_cache=False)


def test_unknown_rope_type_is_one_line(tmp_path):
    cfg = llama_hf_config("default").to_dict()
    cfg["rope_parameters"] = {"rope_type": "ntk-by-parts", "rope_theta": 10000.0}
    with pytest.raises(NotSupportedError) as info:
        AutoBridge.from_hf_config(cfg).to_megatron_provider(load_weights=False)
    message = str(info.value)
    assert "'ntk-by-parts'" in message and "yarn" in message and "longrope" in message and "\n" not in message


def test_interleaved_rotary_matches_megatron_core():
    """rotary_interleaved: Megatron Core's interleaved tables and rotation."""
    import megatron.core.models.common.embeddings.rope_utils as rope_utils  # the oracle: CI installs it

    from longspan.models.rope import apply_rotary

    ours = RotaryEmbedding(16, rotary_percent=0.5, rotary_base=10000, interleaved=True)
    positions = torch.arange(40, 52)
    cos, sin = ours(positions.unsqueeze(0))
    freqs = torch.outer(positions.float(), ours.inv_freq(torch.device("cpu")))
    emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)[:, None, None, :]
    x = torch.randn(1, 12, 2, 16)
    expected = rope_utils._apply_rotary_pos_emb_bshd(x.transpose(0, 1), emb, rotary_interleaved=True)
    torch.testing.assert_close(apply_rotary(x, cos, sin, interleaved=True), expected.transpose(0, 1),
                               atol=1e-6, rtol=1e-6)
    plain = build_gpt_model(llama_config(hidden_dropout=0.0, attention_dropout=0.0), seed=3).eval()
    inter = build_gpt_model(llama_config(hidden_dropout=0.0, attention_dropout=0.0, rotary_interleaved=True),
                            seed=3).eval()
    tokens = torch.randint(0, 100, (2, 12))
    with torch.no_grad():
        assert not torch.allclose(plain(tokens), inter(tokens))


@pytest.mark.parametrize("fields,match", [
    (dict(rope_scaling=True, rope_dynamic_factor=2.0, rope_original_max_position_embeddings=8), "set only one"),
    (dict(rope_dynamic_factor=2.0), "rope_original_max_position_embeddings"),
    (dict(position_embedding_type="yarn"), "yarn_rotary_scaling_factor"),
    (dict(rope_longrope_short_factor=[1.0], rope_longrope_long_factor=[1.0],
          rope_original_max_position_embeddings=8, rope_attention_factor=1.1), "one per rotary frequency"),
])
def test_bad_rope_scaling_fields_are_one_line(fields, match):
    with pytest.raises(ConfigError, match=match) as info:
        build_gpt_model(llama_config(**fields))
    assert "\n" not in str(info.value)


def test_sequence_dependent_scaling_refuses_context_parallel():
    cfg = llama_config(rope_dynamic_factor=2.0, rope_original_max_position_embeddings=8, context_parallel_size=2)
    with pytest.raises(NotSupportedError, match="context_parallel_size=2"):
        build_gpt_model(cfg)
