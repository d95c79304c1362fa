"""OLMoE (``OlmoeForCausalLM``): a tiny random model made with transformers' OlmoeConfig (non-trivial norms,
uneven shapes) has transformers' logits in longspan, exports bit-identically (also from a launched layout),
generates greedily as transformers does, and refuses what longspan cannot build in one line."""

from __future__ import annotations

import pytest
import torch
import transformers

from longspan import AutoBridge
from longspan.cli import main
from longspan.conversion import families
from longspan.core.errors import NotSupportedError
from longspan.data.tokenizers import build_tokenizer
from longspan.inference import generate
from longspan.training.config import TokenizerConfig
from tests.conversion.hf_models import VOCAB, make_tokenizer
from tests.conversion.parity import assert_export_round_trips, hf_logits, read_config, tensors

# Uneven shapes: 5 experts of width 20, 3 layers, 6 heads of width 4 over 2 KV groups, a vocabulary of 96.
SHAPE = dict(vocab_size=VOCAB, hidden_size=24, intermediate_size=20, num_hidden_layers=3, num_attention_heads=6,
             num_key_value_heads=2, num_experts=5, num_experts_per_tok=2, max_position_embeddings=64,
             rms_norm_eps=1e-5, tie_word_embeddings=False, eos_token_id=1, pad_token_id=2, bos_token_id=0)
PROMPT = "def hello(world): return world + 1 the quick"
NEW_TOKENS = 12


def make_olmoe(directory, seed: int = 0, **overrides) -> transformers.OlmoeForCausalLM:
    """Save a random fp32 OLMoE to ``directory`` (norms around 1, routers spread so top-k never ties)."""
    torch.manual_seed(seed)
    model = transformers.OlmoeForCausalLM(transformers.OlmoeConfig(**dict(SHAPE, **overrides)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("gate.weight"):
                p.normal_(0, 1.0)
    model = model.float().eval()
    model.save_pretrained(str(directory))
    make_tokenizer(directory)
    return model


def _tokens(n: int = 14, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_logits_equal_transformers_and_export_is_bit_identical(tmp_path, norm_topk_prob):
    src, out = tmp_path / "hf", tmp_path / "out"
    hf = make_olmoe(src, norm_topk_prob=norm_topk_prob)
    bridge = AutoBridge.from_hf_pretrained(src)
    provider = bridge.to_megatron_provider(load_weights=False)
    assert provider.qk_layernorm and provider.qk_layernorm_across_heads
    assert provider.moe_router_pre_softmax is not norm_topk_prob
    model = bridge.to_megatron_model()
    tokens = _tokens()
    with torch.no_grad():
        ours = model[0].eval()(tokens)
    diff = (ours - hf_logits(hf, tokens)).abs().max().item()
    assert diff <= 1e-4, diff

    assert_export_round_trips(bridge, model, src, out, tokens)
    source = read_config(src)
    regenerated = families.hf_config_dict(families.by_architecture()["OlmoeForCausalLM"], provider)
    for key, value in regenerated.items():
        if key in source and key != "dtype":
            assert source[key] == value or source[key] == pytest.approx(value), key


def test_a_model_exported_as_olmoe_loads_in_transformers(tmp_path):
    """A checkpoint's model exported by architecture name: transformers reads the config.json and computes the
    same logits."""
    src, out = tmp_path / "hf", tmp_path / "out"
    make_olmoe(src, seed=1)
    model = AutoBridge.from_hf_pretrained(src).to_megatron_model()
    provider = AutoBridge.from_hf_pretrained(src).to_megatron_provider(load_weights=False)
    bridge = AutoBridge.from_longspan_provider(provider, "OlmoeForCausalLM")
    bridge.save_hf_pretrained(model, out)
    again = transformers.AutoModelForCausalLM.from_pretrained(str(out)).float().eval()
    assert type(again).__name__ == "OlmoeForCausalLM"
    tokens = _tokens(seed=1)
    with torch.no_grad():
        assert (model[0].eval()(tokens) - hf_logits(again, tokens)).abs().max().item() <= 1e-4


def test_greedy_generate_equals_transformers(tmp_path):
    src = tmp_path / "hf"
    hf = make_olmoe(src, seed=3)
    tokenizer = build_tokenizer(TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(src)))
    prompt_ids = tokenizer.tokenize(PROMPT)
    ids = torch.tensor([prompt_ids])
    hf.config._attn_implementation = "eager"
    expected = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS,
                           eos_token_id=None, pad_token_id=2)[0, len(prompt_ids):].tolist()
    model = AutoBridge.from_hf_pretrained(src).to_megatron_model()
    result = generate(model, tokenizer, PROMPT, max_new_tokens=NEW_TOKENS, eos_ids=())
    assert result.output_ids == expected and len(expected) == NEW_TOKENS


def test_clip_qkv_is_refused_in_one_line(tmp_path):
    src = tmp_path / "hf"
    make_olmoe(src, clip_qkv=8.0)
    with pytest.raises(NotSupportedError, match="clip_qkv=8.0 is not supported"):
        AutoBridge.from_hf_pretrained(src).to_megatron_provider(load_weights=False)


@pytest.mark.slow
def test_launched_expert_parallel_import_then_export_round_trips(tmp_path, pool2):
    """Two workers: the import and the export with the experts split over two ranks (expert parallel)."""
    src, ckpt, out = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "out"
    make_olmoe(src, num_experts=6)  # split evenly over the two ranks
    layout = "model.expert_model_parallel_size=2"
    assert pool2.run(main, ["convert", "import", "--hf-model", str(src), "--output", str(ckpt), "--no-progress",
                            layout], timeout=240) == [0, 0]
    assert pool2.run(main, ["convert", "export", "--checkpoint", str(ckpt), "--output", str(out), "--no-progress",
                            layout], timeout=240) == [0, 0]
    original, exported = tensors(src), tensors(out)
    assert sorted(original) == sorted(exported) and all(torch.equal(exported[k], v) for k, v in original.items())
    assert read_config(out)["architectures"] == ["OlmoeForCausalLM"]
