"""generate(): greedy ids equal transformers' generate(do_sample=False); KV cache == no cache; sampling rules."""

from __future__ import annotations

import pytest
import torch
import transformers

from longspan.core.errors import ConfigError
from longspan.data.tokenizers import NullTokenizer
from longspan.inference import generate, next_token_logits_processor
from longspan.models.gpt import build_gpt_model
from tests.models.gpt_test_config import llama_config, make_config
from tests.models.test_gpt_hf_parity import _gpt2_to_longspan, _llama_to_longspan

NEW_TOKENS = 20


def _llama_pair():
    """A tiny random HF Llama (GQA, untied) with sharp logits, and the same weights in longspan."""
    cfg = llama_config()
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.padded_vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_hidden_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_query_groups, max_position_embeddings=4096, rms_norm_eps=cfg.layernorm_epsilon,
        tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": cfg.rotary_base},
        initializer_range=0.15,  # far from uniform logits: greedy choices are not near-ties
    )
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    model = build_gpt_model(cfg, seed=1).eval()
    model.load_state_dict(_llama_to_longspan(hf.state_dict(), cfg), strict=True)
    return hf, model, cfg.padded_vocab_size


def _gpt2_pair():
    """A tiny random HF GPT-2 (learned positions, LayerNorm, biases, tied) and the same weights in longspan."""
    h, layers, vocab, positions = 64, 2, 128, 64
    cfg = make_config(
        num_layers=layers, hidden_size=h, num_attention_heads=4, ffn_hidden_size=4 * h, vocab_size=vocab,
        make_vocab_size_divisible_by=128, seq_length=positions, normalization="LayerNorm",
        activation_func=torch.nn.functional.gelu, add_bias_linear=True, position_embedding_type="learned_absolute",
        share_embeddings_and_output_weights=True, attention_dropout=0.0, hidden_dropout=0.0,
    )
    hf_cfg = transformers.GPT2Config(
        vocab_size=vocab, n_positions=positions, n_embd=h, n_layer=layers, n_head=4, n_inner=4 * h,
        activation_function="gelu", layer_norm_epsilon=1e-5, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        tie_word_embeddings=True, initializer_range=0.15,
    )
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(hf_cfg).eval()
    model = build_gpt_model(cfg, seed=1).eval()
    model.load_state_dict(_gpt2_to_longspan(hf.state_dict(), cfg), strict=True)
    return hf, model, vocab


PAIRS = {"llama": _llama_pair, "gpt2": _gpt2_pair}


@pytest.fixture(scope="module", params=sorted(PAIRS))
def pair(request):
    return PAIRS[request.param]()


def _prompt(vocab: int, n: int = 7, seed: int = 4) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _hf_greedy(hf, prompt: list[int], eos: int | None, max_new_tokens: int = NEW_TOKENS) -> list[int]:
    out = hf.generate(
        torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long), do_sample=False,
        max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=0,
    )
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("use_cache", [True, False])
def test_greedy_equals_transformers_generate(pair, use_cache):
    hf, model, vocab = pair
    tokenizer = NullTokenizer(vocab - 1)  # ids 0..vocab-1 (its EOD, vocab-1, is not used: eos_ids=())
    for seed in (4, 5):
        prompt = _prompt(vocab, seed=seed)
        expected = _hf_greedy(hf, prompt, eos=None)
        result = generate(model, tokenizer, prompt, max_new_tokens=NEW_TOKENS, use_cache=use_cache, eos_ids=())
        assert result.prompt_ids == prompt
        assert result.output_ids == expected and len(expected) == NEW_TOKENS
        assert result.finish_reason == "length"
        assert len(set(expected)) > 3  # the model does not just repeat one token


def test_stops_at_eos_like_transformers(pair):
    hf, model, vocab = pair
    tokenizer = NullTokenizer(vocab - 1)
    prompt = _prompt(vocab)
    free = _hf_greedy(hf, prompt, eos=None)
    # An EOS that greedy decoding reaches mid-way (its first occurrence): both stop right after it.
    stop_at = next(i for i in range(3, NEW_TOKENS) if free[i] not in free[:i])
    eos = free[stop_at]
    expected = _hf_greedy(hf, prompt, eos=eos)
    assert expected == free[: stop_at + 1]
    for use_cache in (True, False):
        result = generate(model, tokenizer, prompt, max_new_tokens=NEW_TOKENS, use_cache=use_cache, eos_ids=[eos])
        assert result.output_ids == expected and result.finish_reason == "eos"
        assert result.text == tokenizer.detokenize(expected[:-1])  # the EOS token is not part of the text


def test_kv_cache_matches_full_recompute(pair):
    _, model, vocab = pair
    tokenizer = NullTokenizer(vocab - 1)
    prompt = _prompt(vocab, n=5)
    kwargs = dict(max_new_tokens=NEW_TOKENS, eos_ids=(), return_logits=True)
    for sampling in ({}, {"temperature": 0.9, "top_k": 20, "top_p": 0.95, "seed": 11}):
        cached = generate(model, tokenizer, prompt, use_cache=True, **kwargs, **sampling)
        full = generate(model, tokenizer, prompt, use_cache=False, **kwargs, **sampling)
        assert cached.output_ids == full.output_ids
        assert len(cached.logits) == NEW_TOKENS
        for a, b in zip(cached.logits, full.logits):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_kv_cache_forward_equals_full_forward_chunked():
    """Prefill in two chunks (mask offset), then single tokens: every position's logits equal one full pass."""
    from longspan.models.transformer import KVCache

    model = build_gpt_model(llama_config(), seed=3).eval()
    tokens = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache(11)
        parts = [model(tokens[:, :4], kv_cache=cache), model(tokens[:, 4:9], kv_cache=cache)]
        parts += [model(tokens[:, i:i + 1], kv_cache=cache) for i in (9, 10)]
    assert cache.seq_len == 11
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="at most 11"):
        model(tokens[:, :1], kv_cache=cache)


def test_sampling_is_seeded_and_top_k_1_is_greedy():
    _, model, vocab = _llama_pair()
    tokenizer = NullTokenizer(vocab - 1)
    prompt = _prompt(vocab)
    sample = dict(max_new_tokens=NEW_TOKENS, temperature=1.5, eos_ids=())
    a = generate(model, tokenizer, prompt, seed=7, **sample)
    b = generate(model, tokenizer, prompt, seed=7, **sample)
    c = generate(model, tokenizer, prompt, seed=8, **sample)
    greedy = generate(model, tokenizer, prompt, max_new_tokens=NEW_TOKENS, eos_ids=())
    assert a.output_ids == b.output_ids
    assert a.output_ids != c.output_ids and a.output_ids != greedy.output_ids
    top1 = generate(model, tokenizer, prompt, seed=9, top_k=1, **sample)
    assert top1.output_ids == greedy.output_ids
    # The global RNG is not touched by seeded sampling.
    state = torch.get_rng_state()
    generate(model, tokenizer, prompt, seed=7, **sample)
    assert torch.equal(state, torch.get_rng_state())


def test_logits_processing_matches_transformers_warpers():
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = torch.randn(50, generator=torch.Generator().manual_seed(0)) * 3
    for temperature, top_k, top_p in ((0.7, 0, 1.0), (1.0, 5, 1.0), (1.3, 0, 0.8), (0.5, 10, 0.6), (2.0, 3, 0.99)):
        expected = logits[None].clone()
        expected = TemperatureLogitsWarper(temperature)(None, expected)
        if top_k:
            expected = TopKLogitsWarper(top_k)(None, expected)
        if top_p < 1.0:
            expected = TopPLogitsWarper(top_p)(None, expected)
        ours = next_token_logits_processor(logits, None, temperature, top_k, top_p)
        torch.testing.assert_close(ours, expected[0])
    # Padded vocabulary rows are never chosen, greedy or sampled.
    padded = next_token_logits_processor(logits, 40, 0.0, 0, 1.0)
    assert torch.isinf(padded[40:]).all() and torch.equal(padded[:40], logits[:40])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -0.5}, "temperature=-0.5"),
        ({"temperature": float("nan")}, "temperature=nan"),
        ({"top_k": -1}, "top_k=-1"),
        ({"top_p": 0.0}, "top_p=0.0"),
        ({"top_p": 1.5}, "top_p=1.5"),
        ({"max_new_tokens": -1}, "max_new_tokens=-1"),
        ({"prompt": []}, "prompt is empty"),
        ({"max_new_tokens": 60}, "learned positions"),
    ],
)
def test_bad_arguments_are_one_line_errors(kwargs, message):
    _, model, vocab = _gpt2_pair()
    args = {"prompt": [1, 2, 3, 4, 5], **kwargs}
    with pytest.raises(ConfigError, match=message) as err:
        generate(model, NullTokenizer(vocab - 1), **args)
    assert "\n" not in str(err.value)


def test_kv_cache_with_mixture_of_experts():
    """Dropless MoE layers route each new token alone with the cache: same tokens, same logits."""
    from longspan.recipes import get_recipe

    cfg = get_recipe("tiny_moe").model
    cfg.num_layers, cfg.hidden_size, cfg.ffn_hidden_size, cfg.moe_ffn_hidden_size, cfg.vocab_size = 2, 64, 128, 64, 256
    model = build_gpt_model(cfg, seed=1).eval()
    kwargs = dict(max_new_tokens=10, eos_ids=(), return_logits=True)
    cached = generate(model, NullTokenizer(255), [1, 2, 3, 4, 5], **kwargs)
    full = generate(model, NullTokenizer(255), [1, 2, 3, 4, 5], use_cache=False, **kwargs)
    assert cached.output_ids == full.output_ids
    for a, b in zip(cached.logits, full.logits):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_padded_vocabulary_rows_are_never_chosen():
    cfg = llama_config(vocab_size=100)  # padded to 128
    model = build_gpt_model(cfg, seed=1).eval()
    with torch.no_grad():
        model.output_layer.weight[100:] *= 1000.0  # the padding rows would win every argmax
    for sampling in ({}, {"temperature": 1.0, "seed": 0}):
        result = generate(model, NullTokenizer(99), [1, 2, 3], max_new_tokens=10, eos_ids=(), **sampling)
        assert len(result.output_ids) == 10 and max(result.output_ids) < 100
