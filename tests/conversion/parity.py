"""Checks shared by the family acceptance tests: a tiny random HF model saved from a transformers config,
imported into longspan; logits, export and greedy generation compared with transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open

from longspan import AutoBridge
from longspan.data.tokenizers import NullTokenizer
from longspan.inference import generate


def save_random_model(cfg, directory: Path, seed: int = 0):
    """A random fp32 model of HF config ``cfg`` with non-trivial norms, saved to ``directory``; returns it."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model = model.float().eval()
    model.save_pretrained(str(directory))
    return model


def load_hf(directory: Path):
    """A fresh transformers model from ``directory`` (eager attention; fresh RoPE state for dynamic NTK)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(directory), attn_implementation="eager")
    return model.float().eval()


def hf_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=tokens).logits


def ours_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(tokens)


def tensors(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(p for p in Path(directory).iterdir() if p.suffix == ".safetensors"):
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                out[k] = fh.get_tensor(k)
    return out


def read_config(directory: Path) -> dict:
    return json.loads((Path(directory) / "config.json").read_text())


def assert_export_round_trips(bridge: AutoBridge, model, src: Path, out: Path, tokens: torch.Tensor) -> None:
    """Export is bit-identical tensor for tensor, its config.json is equivalent (transformers reads the same
    RoPE / window settings and computes the same logits) and keeps every key longspan reads."""
    bridge.save_hf_pretrained(model, out)
    original, exported = tensors(src), tensors(out)
    assert sorted(original) == sorted(exported)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    before, after = read_config(src), read_config(out)
    assert after["architectures"] == before["architectures"] and after["model_type"] == before["model_type"]
    a, b = transformers.AutoConfig.from_pretrained(str(src)), transformers.AutoConfig.from_pretrained(str(out))
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "vocab_size", "rms_norm_eps", "tie_word_embeddings", "sliding_window",
                "use_sliding_window", "max_window_layers", "layer_types", "partial_rotary_factor"):
        assert getattr(a, key, None) == getattr(b, key, None), key
    pa, pb = dict(a.rope_parameters), dict(b.rope_parameters)
    for key, value in pa.items():  # every setting transformers read; the export may spell out its defaults
        assert pb.get(key) == value or pb.get(key) == pytest.approx(value), (key, value, pb.get(key))
    assert torch.equal(hf_logits(load_hf(out), tokens), hf_logits(load_hf(src), tokens))


def greedy_hf(hf, prompt: list[int], new_tokens: int, use_cache: bool = True) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens, eos_token_id=None,
                      pad_token_id=0, use_cache=use_cache)
    return out[0, len(prompt):].tolist()


def greedy_ours(model, vocab: int, prompt: list[int], new_tokens: int, use_cache: bool = True) -> list[int]:
    result = generate(model, NullTokenizer(vocab - 1), prompt, max_new_tokens=new_tokens, use_cache=use_cache,
                      eos_ids=())
    return result.output_ids


def prompt_ids(vocab: int, n: int, seed: int = 3) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
