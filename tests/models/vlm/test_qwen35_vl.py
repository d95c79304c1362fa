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
from tests.helpers.vlm import assert_export_bit_identical, hf_greedy_ids
from tests.models.vlm.qwen3_vl_fixtures import PROMPT, make_qwen35_vl
from tests.models.vlm.qwen_vl_fixtures import (VOCAB, assert_logits_equal_transformers, draw_image,
                                               image_inputs, processed)


@pytest.fixture(scope="module")
def qwen35_vl(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen35_vl")
    hf = make_qwen35_vl(directory)
    inputs = processed(directory, PROMPT, [draw_image(64, 64, seed=1), draw_image(96, 32, seed=2)])
    model = AutoBridge.from_hf_pretrained(directory).to_megatron_model()[0].eval()
    return directory, hf, inputs, model


def test_logits_equal_transformers_on_two_images(qwen35_vl):
    _, hf, inputs, model = qwen35_vl
    assert type(model.config).__name__ == "Qwen35VLModelProvider" and model.config.rotary_percent == 0.5
    assert_logits_equal_transformers(hf, model, inputs, atol=1e-4)


def test_export_is_bit_identical_with_the_processor_files(qwen35_vl, tmp_path):
    directory, _, _, model = qwen35_vl
    AutoBridge.from_hf_pretrained(directory).save_hf_pretrained(model, tmp_path)
    assert_export_bit_identical(directory, tmp_path, ("preprocessor_config.json", "chat_template.jinja",
                                                     "tokenizer.json"))
    reloaded = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(str(tmp_path)).eval()
    assert reloaded.config.text_config.layer_types == ["linear_attention", "full_attention"]


def test_greedy_generate_with_images_equals_transformers(qwen35_vl):
    _, hf, inputs, model = qwen35_vl
    prompt = inputs["input_ids"]
    result = generate(model, NullTokenizer(VOCAB - 1), prompt[0].tolist(), max_new_tokens=5, eos_ids=(),
                      use_cache=True, model_inputs=image_inputs(inputs))
    assert result.output_ids == hf_greedy_ids(hf, inputs, 5)


def test_the_moe_variant_equals_transformers_and_exports_bit_identically(tmp_path):
    """``Qwen3_5MoeForConditionalGeneration`` (experts and a gated shared expert on both layers)."""
    directory = tmp_path / "moe"
    hf = make_qwen35_vl(directory, moe=True)
    inputs = processed(directory, PROMPT, [draw_image(64, 64, seed=1), draw_image(96, 32, seed=2)])
    bridge = AutoBridge.from_hf_pretrained(directory)
    model = bridge.to_megatron_model()[0].eval()
    assert type(model.config).__name__ == "Qwen35VLMoEModelProvider" and model.config.num_moe_experts == 4
    with torch.no_grad():
        torch.testing.assert_close(model(inputs["input_ids"], **image_inputs(inputs)), hf(**inputs).logits, rtol=0,
                                   atol=1e-4)
    bridge.save_hf_pretrained(model, tmp_path / "out")
    assert_export_bit_identical(directory, tmp_path / "out")


def test_a_text_recipe_on_the_vision_language_directory_takes_its_text_tower(qwen35_vl):
    """The ``qwen35`` recipe (a text model) on a Qwen3.5-with-images directory builds and loads its language model
    alone, whose text logits are transformers'."""
    from longspan.recipes.loading import load_config
    from longspan.training.checkpointing.hf_weights import apply_hf_model_config, load_hf_pretrained

    directory, hf, inputs, _ = qwen35_vl
    cfg = load_config("qwen35")
    apply_hf_model_config(cfg, directory)
    assert type(cfg.model).__name__ == "GPTModelProvider"
    text = cfg.model.provide()
    assert load_hf_pretrained(directory, [text]) > 0
    tokens = inputs["input_ids"][:, :4]  # without pixels the image tokens are plain tokens
    with torch.no_grad():
        torch.testing.assert_close(text.eval()(tokens), hf(input_ids=tokens).logits, rtol=0, atol=1e-4)
