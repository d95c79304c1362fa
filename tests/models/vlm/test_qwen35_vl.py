"""Qwen3.5 with images (``Qwen3_5ForConditionalGeneration``: Qwen3-VL's encoder without DeepStack on the gated
DeltaNet hybrid, partial interleaved mRoPE), a tiny random model made here, against transformers: logits on a
prompt with two images of different sizes, bit-identical export with the processor files, greedy generation."""

from __future__ import annotations

import pytest
import torch
import transformers

from longspan import AutoBridge
from longspan.data.tokenizers import NullTokenizer
from longspan.inference import generate
from tests.conversion.parity import tensors
from tests.models.vlm.qwen3_vl_fixtures import PROMPT, image_processor
from tests.models.vlm.qwen_vl_fixtures import CHAT_TEMPLATE, VOCAB, draw_image, make_tokenizer, processed


@pytest.fixture(scope="module")
def qwen35_vl(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen35_vl")
    tok = make_tokenizer()
    special = {name: tok.convert_tokens_to_ids(t) for name, t in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))}
    # a DeltaNet layer and a gated-attention layer; half of each 16-channel head rotates: 4 pairs T H W T
    text = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=3,
                layer_types=["linear_attention", "full_attention"], max_position_embeddings=256,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                 "mrope_section": [2, 1, 1], "mrope_interleaved": True})
    vision = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=32, patch_size=16,
                  spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=25)
    torch.manual_seed(0)
    hf = transformers.Qwen3_5ForConditionalGeneration(
        transformers.Qwen3_5Config(text_config=text, vision_config=vision, **special))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:  # the (1 + w) norms of the language model, the encoder's plain LayerNorms
                p.copy_(torch.empty(p.shape).uniform_(-0.4, 0.4, generator=g) + (0.0 if "language" in name else 1.0))
            elif name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(-1.0, 1.0, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    hf = hf.float().eval()
    hf.save_pretrained(str(directory))
    tok.save_pretrained(str(directory))
    image_processor().save_pretrained(str(directory))
    (directory / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    inputs = processed(directory, PROMPT, [draw_image(64, 64, seed=1), draw_image(96, 32, seed=2)])
    model = AutoBridge.from_hf_pretrained(directory).to_megatron_model()[0].eval()
    return directory, hf, inputs, model


def _image_inputs(inputs):
    return {"pixel_values": inputs["pixel_values"], "image_grid_thw": inputs["image_grid_thw"]}


def test_logits_equal_transformers_on_two_images(qwen35_vl):
    _, hf, inputs, model = qwen35_vl
    assert type(model.config).__name__ == "Qwen35VLModelProvider" and model.config.rotary_percent == 0.5
    with torch.no_grad():
        expected = hf(**inputs).logits
        ours = model(inputs["input_ids"], **_image_inputs(inputs))
        other_pixels = model(inputs["input_ids"], pixel_values=inputs["pixel_values"].flip(0),
                             image_grid_thw=inputs["image_grid_thw"])
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-4)
    assert (other_pixels - ours).abs().max() > 1e-2


def test_export_is_bit_identical_with_the_processor_files(qwen35_vl, tmp_path):
    directory, _, _, model = qwen35_vl
    AutoBridge.from_hf_pretrained(directory).save_hf_pretrained(model, tmp_path)
    original, exported = tensors(directory), tensors(tmp_path)
    assert sorted(original) == sorted(exported)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    for name in ("preprocessor_config.json", "chat_template.jinja", "tokenizer.json"):
        assert (tmp_path / name).read_bytes() == (directory / name).read_bytes(), name
    reloaded = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(str(tmp_path)).eval()
    assert reloaded.config.text_config.layer_types == ["linear_attention", "full_attention"]


def test_greedy_generate_with_images_equals_transformers(qwen35_vl):
    _, hf, inputs, model = qwen35_vl
    prompt = inputs["input_ids"]
    out = hf.generate(**inputs, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=5,
                      min_new_tokens=5, eos_token_id=None, pad_token_id=0)
    result = generate(model, NullTokenizer(VOCAB - 1), prompt[0].tolist(), max_new_tokens=5, eos_ids=(),
                      use_cache=True, model_inputs=_image_inputs(inputs))
    assert result.output_ids == out[0, prompt.shape[1]:].tolist()
