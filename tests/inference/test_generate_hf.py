"""Generation from a Hugging Face model directory (AutoBridge import): ids equal transformers' generate."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers

from longspan.cli import main
from longspan.conversion import AutoBridge
from longspan.data.tokenizers import build_tokenizer
from longspan.inference import generate
from longspan.training.config import TokenizerConfig
from tests.inference.helpers import train_bpe_tokenizer

NEW_TOKENS = 20
PROMPT = "def f12(x): return"


def _hf_config(arch: str, vocab: int, eos: int):
    common = dict(vocab_size=vocab, eos_token_id=eos, bos_token_id=None, pad_token_id=None, initializer_range=0.15)
    if arch == "llama":
        return transformers.LlamaConfig(
            hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, tie_word_embeddings=False, **common,
        ), transformers.LlamaForCausalLM
    return transformers.GPT2Config(
        n_positions=64, n_embd=64, n_layer=2, n_head=4, activation_function="gelu", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **common,
    ), transformers.GPT2LMHeadModel


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def hf_dir(request, tmp_path_factory):
    """A tiny random HF model saved with a BPE tokenizer; EOS = the tokenizer's <|endoftext|>."""
    base = tmp_path_factory.mktemp(f"hf_{request.param}")
    tok_dir = train_bpe_tokenizer(base / "tok")
    tokenizer = build_tokenizer(TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tok_dir)))
    config, cls = _hf_config(request.param, tokenizer.vocab_size, tokenizer.eos)
    torch.manual_seed(0)
    model = cls(config).eval()
    directory = base / "model"
    model.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tok_dir / name, directory / name)
    return directory


def _transformers_greedy(directory, prompt_ids, eos=None):
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").eval()
    kwargs = {} if eos is None else {"eos_token_id": eos}
    out = hf.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                      do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=0, **kwargs)
    return out[0, len(prompt_ids):].tolist()


def test_autobridge_model_greedy_equals_transformers(hf_dir):
    model = AutoBridge.from_hf_pretrained(hf_dir).to_megatron_model(wrap_with_ddp=False)
    tokenizer = build_tokenizer(TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(hf_dir)))
    prompt_ids = tokenizer.tokenize(PROMPT)
    free = _transformers_greedy(hf_dir, prompt_ids, eos=[])  # never stops early
    result = generate(model, tokenizer, PROMPT, max_new_tokens=NEW_TOKENS, eos_ids=())
    assert result.output_ids == free and len(free) == NEW_TOKENS and len(set(free)) > 3
    cached_off = generate(model, tokenizer, PROMPT, max_new_tokens=NEW_TOKENS, eos_ids=(), use_cache=False)
    assert cached_off.output_ids == free


def _cli_json(capsys, directory) -> dict:
    capsys.readouterr()
    assert main(["generate", "--hf-model", str(directory), "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS),
                 "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_hf_model_json_equals_transformers(hf_dir, capsys, tmp_path):
    tokenizer = build_tokenizer(TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(hf_dir)))
    prompt_ids = tokenizer.tokenize(PROMPT)
    expected = _transformers_greedy(hf_dir, prompt_ids)  # stops at config.json's eos_token_id, like the CLI
    payload = _cli_json(capsys, hf_dir)
    assert payload["prompt_ids"] == prompt_ids
    assert payload["output_ids"] == expected
    assert payload["text"] == tokenizer.detokenize(expected)

    # generation_config.json's eos_token_id list (as Llama 3 ships it) ends generation where transformers stops.
    stop_at = next(i for i in range(3, NEW_TOKENS) if expected[i] not in expected[:i])
    eos_list = [tokenizer.eos, expected[stop_at]]
    directory = tmp_path / "with_generation_config"
    shutil.copytree(hf_dir, directory)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_list}))
    stopped = _transformers_greedy(directory, prompt_ids)
    assert stopped == expected[: stop_at + 1]
    payload = _cli_json(capsys, directory)
    assert payload["output_ids"] == stopped
    assert payload["text"] == tokenizer.detokenize(stopped[:-1])  # the EOS token is not part of the text
