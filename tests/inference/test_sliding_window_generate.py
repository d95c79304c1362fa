"""A Hugging Face Mistral with ``sliding_window`` (tiny, random, made here): import gives transformers' logits,
export is bit-identical with the same ``sliding_window``, and greedy ``generate`` (KV cache keeping only the
window, and without cache; the CLI too) equals transformers' ``generate(do_sample=False)`` token for token,
with prompts several windows long."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from longspan import AutoBridge
from longspan.cli import main
from longspan.conversion import families
from longspan.core.errors import NotSupportedError
from longspan.data.tokenizers import build_tokenizer
from longspan.inference import generate
from longspan.models.transformer import KVCache
from longspan.training.config import TokenizerConfig
from tests.conversion.hf_models import VOCAB, hf_logits, make_hf_model, read_config

WINDOW = 8
NEW_TOKENS = 24
PROMPT = "the quick brown fox jumps over the lazy dog def hello(world): return world + 1 the lazy dog"


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory):
    """3 layers, sliding_window=8, a wide init (no near-ties in greedy), EOS = the tokenizer's <eos> (id 1)."""
    directory = tmp_path_factory.mktemp("mistral_swa")
    make_hf_model("mistral", directory, sliding_window=WINDOW, num_hidden_layers=3, initializer_range=0.2,
                  eos_token_id=1, bos_token_id=None, pad_token_id=2)
    return directory


def _tokenizer(directory):
    return build_tokenizer(TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(directory)))


def _hf_greedy(directory, prompt_ids: list[int], eos=None) -> list[int]:
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(directory), attn_implementation="eager").eval()
    kwargs = {} if eos is None else {"eos_token_id": eos}
    out = hf.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                      do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=2, **kwargs)
    return out[0, len(prompt_ids):].tolist()


def test_import_window_logits_and_bit_identical_export(mistral_dir, tmp_path):
    bridge = AutoBridge.from_hf_pretrained(mistral_dir)
    provider = bridge.to_megatron_provider()
    assert provider.window_size == [WINDOW - 1, 0] and provider.window_attn_skip_freq is None
    model = bridge.to_megatron_model()[0].eval()
    assert [layer.self_attention.window for layer in model.decoder.layers.values()] == [WINDOW] * 3
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(mistral_dir)).eval()
    tokens = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(0))  # 5 windows long
    with torch.no_grad():
        ours = model(tokens)
    assert (ours - hf_logits(hf, tokens)).abs().max().item() <= 1e-5
    # a model that ignored the window would differ from transformers after the first window
    no_window = transformers.AutoModelForCausalLM.from_pretrained(str(mistral_dir), sliding_window=None).eval()
    assert (hf_logits(no_window, tokens) - ours).abs()[:, WINDOW:].max().item() > 1e-3

    bridge.save_hf_pretrained([model], tmp_path / "out")
    assert read_config(tmp_path / "out")["sliding_window"] == WINDOW
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    for name, tensor in hf.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name
    assert torch.equal(hf_logits(again, tokens), hf_logits(hf, tokens))


def test_export_refuses_a_window_its_family_cannot_hold():
    hf_cfg = transformers.MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, sliding_window=WINDOW)
    provider = AutoBridge.from_hf_config(dict(hf_cfg.to_dict(), architectures=["MistralForCausalLM"])
                                         ).to_megatron_provider(load_weights=False)
    assert families.family_for_provider(provider).architecture == "MistralForCausalLM"
    assert families.hf_config_dict(families.by_architecture()["MistralForCausalLM"], provider)["sliding_window"] == 8
    with pytest.raises(NotSupportedError, match="Llama has no sliding-window attention"):
        families.hf_config_dict(families.by_architecture()["LlamaForCausalLM"], provider)
    provider.window_attn_skip_freq = 2
    with pytest.raises(NotSupportedError, match="Mistral applies its sliding window to every layer"):
        families.hf_config_dict(families.by_architecture()["MistralForCausalLM"], provider)


def test_greedy_generate_equals_transformers_with_a_prompt_longer_than_the_window(mistral_dir):
    model = AutoBridge.from_hf_pretrained(mistral_dir).to_megatron_model()
    tokenizer = _tokenizer(mistral_dir)
    prompt_ids = tokenizer.tokenize(PROMPT)
    assert len(prompt_ids) > 2 * WINDOW
    expected = _hf_greedy(mistral_dir, prompt_ids, eos=[])  # never stops early
    assert len(expected) == NEW_TOKENS and len(set(expected)) > 3
    cached = generate(model, tokenizer, prompt_ids, max_new_tokens=NEW_TOKENS, eos_ids=())
    assert cached.output_ids == expected
    recomputed = generate(model, tokenizer, prompt_ids, max_new_tokens=NEW_TOKENS, eos_ids=(), use_cache=False)
    assert recomputed.output_ids == expected


def test_kv_cache_of_a_windowed_model_is_bounded_by_the_window(mistral_dir):
    net = AutoBridge.from_hf_pretrained(mistral_dir).to_megatron_model()[0].eval()
    tokens = torch.randint(0, VOCAB, (1, 50), generator=torch.Generator().manual_seed(2))
    cache = KVCache(50)
    with torch.no_grad():
        steps = [net(tokens[:, :20], kv_cache=cache)]
        for i in range(20, 50):
            steps.append(net(tokens[:, i:i + 1], kv_cache=cache))
            assert {tuple(k.shape[2:3]) for k in cache.keys.values()} == {(WINDOW - 1,)}
        torch.testing.assert_close(torch.cat(steps, dim=1), net(tokens), atol=1e-5, rtol=1e-5)


def test_cli_generate_equals_transformers(mistral_dir, capsys):
    tokenizer = _tokenizer(mistral_dir)
    prompt_ids = tokenizer.tokenize(PROMPT)
    expected = _hf_greedy(mistral_dir, prompt_ids)  # stops at config.json's eos_token_id, like the CLI
    capsys.readouterr()
    assert main(["generate", "--hf-model", str(mistral_dir), "--prompt", PROMPT, "--max-new-tokens",
                 str(NEW_TOKENS), "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["prompt_ids"] == prompt_ids
    assert payload["output_ids"] == expected
