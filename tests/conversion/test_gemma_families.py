"""Gemma 2, Gemma 3 (text, and the vision-language model on text-only prompts) and OLMo-2 through AutoBridge:
logits equal transformers' (sliding windows shorter than the prompts), import -> export is bit-identical with an
equivalent config.json, and greedy ``longspan generate`` equals transformers' ``generate``. Images:
tests/conversion/test_gemma_vlm.py."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file

from longspan import AutoBridge
from longspan.cli import main
from longspan.conversion import families
from longspan.core.errors import NotSupportedError
from longspan.data.tokenizers import build_tokenizer
from longspan.inference import generate
from longspan.training.config import TokenizerConfig
from tests.conversion.gemma_models import GEMMA_FAMILIES, WINDOW, hf_logits, make_gemma_model
from tests.conversion.hf_models import VOCAB, read_config

PROMPT = "def hello(world): return world + 1 the quick"
NEW_TOKENS = 16


def _tensors(directory) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(p for p in directory.iterdir() if p.suffix == ".safetensors"):
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                out[k] = fh.get_tensor(k)
    return out


def _tokens(n=14, seed=0):
    return torch.randint(0, VOCAB, (2, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", GEMMA_FAMILIES)
def test_logits_equal_transformers_and_export_is_bit_identical(family, tmp_path):
    src, out = tmp_path / "hf", tmp_path / "out"
    hf = make_gemma_model(family, src)
    bridge = AutoBridge.from_hf_pretrained(src)
    model = bridge.to_megatron_model()
    tokens = _tokens()
    assert tokens.shape[1] > WINDOW
    with torch.no_grad():
        ours = model[0].eval()(tokens)
    assert ours.shape[-1] == VOCAB
    diff = (ours - hf_logits(hf, tokens)).abs().max().item()
    assert diff <= 1e-5, diff

    bridge.save_hf_pretrained(model, out)
    original, exported = _tensors(src), _tensors(out)
    assert sorted(original) == sorted(exported)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    # config.json: every key the translation writes equals the source's (the VLM's text config: its text tower).
    source_cfg = read_config(src)
    exported_cfg = read_config(out)
    expected_arch = source_cfg["architectures"][0]
    assert exported_cfg["architectures"] == [expected_arch]
    regenerated = families.hf_config_dict(families.by_architecture()[expected_arch], bridge.to_megatron_provider())
    if family == "gemma3_vlm":
        source_cfg, regenerated = source_cfg["text_config"], regenerated["text_config"]
    for key, value in regenerated.items():
        if key in source_cfg and key not in ("architectures", "dtype"):
            assert source_cfg[key] == value or (isinstance(value, float) and source_cfg[key] == pytest.approx(value)), key
    # transformers loads the export and computes the source's logits.
    again, source = hf_logits(transformers.AutoModelForCausalLM.from_pretrained(str(out)), tokens), hf_logits(hf, tokens)
    assert torch.equal(again, source)


@pytest.mark.parametrize("family", GEMMA_FAMILIES)
def test_greedy_generate_equals_transformers(family, tmp_path, capsys):
    src = tmp_path / "hf"
    make_gemma_model(family, src, seed=3)
    tokenizer = build_tokenizer(TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(src)))
    prompt_ids = tokenizer.tokenize(PROMPT)
    assert len(prompt_ids) > WINDOW
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(src), attn_implementation="eager").eval()
    ids = torch.tensor([prompt_ids])
    free = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS,
                       eos_token_id=None, pad_token_id=0)[0, len(prompt_ids):].tolist()
    model = AutoBridge.from_hf_pretrained(src).to_megatron_model()
    result = generate(model, tokenizer, PROMPT, max_new_tokens=NEW_TOKENS, eos_ids=())
    assert result.output_ids == free and len(free) == NEW_TOKENS

    # The command line (stops at config.json's eos_token_id, as transformers does by default).
    stopping = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS,
                           pad_token_id=0)[0, len(prompt_ids):].tolist()
    capsys.readouterr()
    assert main(["generate", "--hf-model", str(src), "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS),
                 "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["prompt_ids"] == prompt_ids and payload["output_ids"] == stopping


def test_vision_language_checkpoint_with_module_names_loads(tmp_path):
    """Files named after transformers' modules (model.language_model.*, not the hub's language_model.model.*)."""
    src = tmp_path / "hf"
    hf = make_gemma_model("gemma3_vlm", src, tokenizer=False)
    renamed = {}
    for name, tensor in _tensors(src).items():
        if name.startswith("language_model.model."):
            name = "model.language_model." + name[len("language_model.model."):]
        renamed[name] = tensor
    save_file(renamed, str(src / "model.safetensors"))
    model = AutoBridge.from_hf_pretrained(src).to_megatron_model()
    tokens = _tokens()
    with torch.no_grad():
        assert (model[0].eval()(tokens) - hf_logits(hf, tokens)).abs().max().item() <= 1e-5


def _provider_fields(family: str, tmp_path, **overrides) -> dict:
    make_gemma_model(family, tmp_path, tokenizer=False)
    cfg = read_config(tmp_path)
    target = cfg["text_config"] if family == "gemma3_vlm" else cfg
    target.update(overrides)
    return families.family_for_config(cfg).to_provider(cfg)


def test_config_translation_fields(tmp_path):
    gemma3 = _provider_fields("gemma3", tmp_path / "a")
    assert gemma3["rotary_base"] == [10000, 1000000] and gemma3["rope_scaling_factor"] == 8.0
    assert gemma3["window_size"] == [WINDOW - 1, 0] and gemma3["window_attn_skip_freq"] == [1, 1, 0, 1]
    assert gemma3["layernorm_zero_centered_gamma"] and gemma3["layernorm_after_sublayers"]
    assert gemma3["apply_embedding_scaling"] and gemma3["qk_layernorm"] and gemma3["softmax_scale"] == 8 ** -0.5
    gemma2 = _provider_fields("gemma2", tmp_path / "b")
    assert (gemma2["attn_logit_softcapping"], gemma2["final_logit_softcapping"]) == (3.0, 4.0)
    assert gemma2["window_attn_skip_freq"] == [1, 0, 1, 0] and gemma2["share_embeddings_and_output_weights"]
    olmo2 = _provider_fields("olmo2", tmp_path / "c")
    assert olmo2["layernorm_before_sublayers"] is False and olmo2["qk_layernorm_across_heads"]


@pytest.mark.parametrize("family, overrides, message", [
    ("gemma3", {"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                    "full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}}},
     r"rope_parameters.full_attention.rope_type='yarn' is not supported: longspan implements 'default' and 'linear'"),
    ("gemma3", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping / final_logit_softcapping"),
    ("gemma2", {"use_bidirectional_attention": True}, "use_bidirectional_attention=true is not supported"),
    ("gemma2", {"attention_bias": True}, "attention_bias=true is not supported for gemma2"),
    ("olmo2", {"hidden_act": "mish"}, "hidden_act='mish' is not supported: use one of"),
    ("gemma3_vlm", {"layer_types": ["sliding_attention", "chunked_attention", "full_attention",
                                    "sliding_attention"]}, r"layer_types\[1\]='chunked_attention' is not supported"),
])
def test_unsupported_config_values_are_one_line_errors(family, overrides, message, tmp_path):
    with pytest.raises(NotSupportedError, match=message) as info:
        _provider_fields(family, tmp_path, **overrides)
    assert "\n" not in str(info.value)


def test_longspan_gemma_shaped_model_exports_as_gemma(tmp_path):
    """A provider built in longspan (not imported) picks its HF architecture from its norms."""
    src = tmp_path / "hf"
    make_gemma_model("gemma3", src, tokenizer=False)
    provider = AutoBridge.from_hf_pretrained(src).to_megatron_provider()
    assert families.family_for_provider(provider).architecture == "Gemma3ForCausalLM"
    provider.qk_layernorm = False
    assert families.family_for_provider(provider).architecture == "Gemma2ForCausalLM"
    provider.layernorm_before_sublayers = False
    assert families.family_for_provider(provider).architecture == "Olmo2ForCausalLM"
