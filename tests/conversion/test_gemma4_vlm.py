"""Gemma 4 with images (Gemma4ForConditionalGeneration) through AutoBridge: logits on a prompt with two images of
different sizes equal transformers' (fp32, 1e-4), import -> export is bit-identical with the processor files
copied, greedy generation with an image equals transformers' ``generate``, and images too small to pool and audio
inputs are one-line errors before anything runs."""

from __future__ import annotations


import pytest
import torch
import transformers

from longspan import AutoBridge
from longspan.conversion import families
from longspan.core.errors import ConfigError, DataError, NotSupportedError
from longspan.inference.image_generation import generate_from_hf_with_images, generate_with_images
from longspan.families.gemma_vl.model import image_attention_mask
from longspan.models.sliding_window import TwoSidedMask
from longspan.training.checkpointing.hf_weights import hf_bridge
from tests.conversion.gemma4_vlm_models import VOCAB, make_gemma4_vlm
from tests.conversion.gemma_vlm_models import draw_image
from tests.helpers.vlm import (assert_export_bit_identical, assert_provider_export_reads_back, assert_same_config_json,
                               hf_greedy_ids)

PROMPT = "describe <|image|> the picture and <|image|> a dot"


def _images():
    """A square picture (64 soft tokens after the processor's resize) and a wide one (55)."""
    return [draw_image(0, 40), draw_image(1, 48).resize((24, 12))]


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """(directory, transformers model, processor, processor inputs of PROMPT with two images, bridge, model)."""
    src = tmp_path_factory.mktemp("gemma4_vlm")
    hf, processor = make_gemma4_vlm(src)
    inputs = processor(text=PROMPT, images=_images(), return_tensors="pt")
    bridge = AutoBridge.from_hf_pretrained(src)
    model = bridge.to_megatron_model()[0].eval()
    return src, hf, processor, inputs, bridge, model


def _ours(model, inputs, **overrides):
    kwargs = dict(pixel_values=inputs["pixel_values"], image_position_ids=inputs["image_position_ids"])
    kwargs.update(overrides)
    with torch.no_grad():
        return model(inputs["input_ids"], **kwargs)[..., :VOCAB]


def test_logits_with_two_images_of_different_sizes_equal_transformers(vlm):
    _, hf, _, inputs, _, model = vlm
    soft = int((inputs["input_ids"] == model.image_token_id).sum())
    assert inputs["pixel_values"].shape[0] == 2 and soft == 64 + 55
    with torch.no_grad():
        reference = hf(**inputs).logits
    assert (_ours(model, inputs) - reference).abs().max().item() <= 1e-4
    # Each piece matters: no images, the images' patch positions swapped, the per-layer inputs of the image
    # tokens taken from another id than the pad token give other logits.
    assert (_ours(model, inputs, pixel_values=None) - reference).abs().max().item() > 1e-3
    swapped = inputs["image_position_ids"].flip(-1)
    assert (_ours(model, inputs, image_position_ids=swapped) - reference).abs().max().item() > 1e-3
    model.pad_token_id = 3
    try:
        assert (_ours(model, inputs) - reference).abs().max().item() > 1e-4
    finally:
        model.pad_token_id = 0
    # The per-token loss with labels is the cross-entropy of those logits.
    labels = inputs["input_ids"].roll(-1, dims=1)
    with torch.no_grad():
        loss = model(inputs["input_ids"], labels=labels, pixel_values=inputs["pixel_values"],
                     image_position_ids=inputs["image_position_ids"])
    expected = torch.nn.functional.cross_entropy(reference[0], labels[0], reduction="none")
    assert (loss[0] - expected).abs().max().item() <= 1e-4


def test_image_tokens_see_each_other_on_the_sliding_window_layers_as_transformers(tmp_path):
    """``use_bidirectional_attention='vision'``: an image's tokens see each other both ways on the sliding-window
    layers (whose 24-token window cuts inside the 64-token image), the full-attention layers stay causal."""
    hf, processor = make_gemma4_vlm(tmp_path, seed=1, bidirectional="vision", vision_layers=1)
    inputs = processor(text=PROMPT, images=_images(), return_tensors="pt")
    model = AutoBridge.from_hf_pretrained(tmp_path).to_megatron_model()[0].eval()
    assert model.config.use_bidirectional_attention == "vision"
    with torch.no_grad():
        reference = hf(**inputs).logits
    assert (_ours(model, inputs) - reference).abs().max().item() <= 1e-4
    expected = hf_greedy_ids(hf, inputs, 4)
    assert generate_with_images(model, processor, PROMPT, _images(), max_new_tokens=4, eos_ids=()).output_ids == expected
    # Causal attention everywhere, or the image blocks on the full-attention layers too, give other logits.
    model.config.use_bidirectional_attention = None
    assert (_ours(model, inputs) - reference).abs().max().item() > 1e-3
    model.config.use_bidirectional_attention = "vision"
    every_layer = lambda ids, mask: TwoSidedMask(image_attention_mask((ids == model.image_token_id).long()).mask)
    original, model._image_blocks = model._image_blocks, lambda ids, mask, past: every_layer(ids, mask)
    try:
        assert (_ours(model, inputs) - reference).abs().max().item() > 1e-3
    finally:
        model._image_blocks = original


def test_import_export_is_bit_identical_with_the_processor_files(vlm, tmp_path):
    src, hf, _, inputs, bridge, model = vlm
    out = tmp_path / "out"
    bridge.save_hf_pretrained([model], out)
    original = assert_export_bit_identical(src, out, ("processor_config.json", "tokenizer.json",
                                                      "tokenizer_config.json", "chat_template.jinja"))
    assert any(k.endswith("input_min") for k in original) and "model.vision_tower.std_scale" in original
    assert_same_config_json(src, out)

    # A model built in longspan exports as Gemma4ForConditionalGeneration from its provider alone.
    assert_provider_export_reads_back(bridge, model, hf, inputs, tmp_path / "fresh",
                                      transformers.Gemma4ForConditionalGeneration, atol=1e-5)


def test_greedy_generate_with_an_image_equals_transformers(vlm, tmp_path):
    src, hf, processor, _, _, model = vlm
    image = tmp_path / "picture.png"
    _images()[1].save(image)
    prompt = "describe <|image|> the"
    inputs = processor(text=prompt, images=[_images()[1]], return_tensors="pt")
    expected = hf_greedy_ids(hf, inputs, 8)
    result = generate_with_images(model, processor, prompt, [image], max_new_tokens=8, eos_ids=())
    assert result.prompt_ids == inputs["input_ids"][0].tolist()
    assert result.output_ids == expected and len(expected) == 8
    # From the HF directory (its processor loads without the video processor transformers cannot build here).
    again = generate_from_hf_with_images(src, prompt, [str(image)], max_new_tokens=8, eos_ids=())
    assert again.output_ids == expected


def test_small_images_and_audio_are_one_line_errors(vlm, tmp_path):
    src, _, processor, inputs, bridge, model = vlm
    # Without the processor's resize an 8x4-pixel image is 2x1 patches: not one 2x2 pooled soft token.
    small = processor(text="a <|image|>", images=[draw_image(0, 40).resize((8, 4))], do_resize=False,
                      return_tensors="pt")
    cases = [
        (lambda: model(small["input_ids"], pixel_values=small["pixel_values"],
                       image_position_ids=small["image_position_ids"]),
         DataError, r"image 1 is 2x1 patches, too small or uneven for the 2x2 pooling"),
        (lambda: _ours(model, inputs, input_features=torch.zeros(1, 8, 128)),
         NotSupportedError, "input_features: audio inputs are not supported yet for Gemma 4"),
        (lambda: _ours(model, inputs, pixel_values=inputs["pixel_values"][:1],
                       image_position_ids=inputs["image_position_ids"][:1]),
         DataError, "119 image tokens .* for the 64 soft tokens of its 1 image"),
        (lambda: _ours(model, inputs, image_position_ids=None), DataError, "image_position_ids has shape None"),
        (lambda: families.family_for_config(dict(bridge.hf_config, audio_config={"hidden_size": 8})).to_provider(
            dict(bridge.hf_config, audio_config={"hidden_size": 8})),
         NotSupportedError, "config.json audio_config: Gemma 4's audio encoder is not supported yet"),
    ]
    for call, error, message in cases:
        with pytest.raises(error, match=message) as info:
            call()
        assert "\n" not in str(info.value)


def test_a_text_run_on_the_directory_takes_its_language_model(vlm):
    """A text recipe on a Gemma 4 vision-language directory imports the language model alone (the family's text
    tower); its logits on text equal the whole model's."""
    src, hf, processor = vlm[0], vlm[1], vlm[2]
    bridge = hf_bridge(src, text_model=True)
    assert bridge.family.name == "gemma4_vl_text"
    model = bridge.to_megatron_model()[0].eval()
    tokens = processor.tokenizer("the picture and a dot of the cat", return_tensors="pt").input_ids
    with torch.no_grad():
        assert (model(tokens) - hf(input_ids=tokens).logits).abs().max().item() <= 1e-4


def test_provider_freezes_parts_and_checks_its_vision_fields(vlm):
    provider = vlm[4].to_megatron_provider(load_weights=False)
    provider.freeze_vision_model = provider.freeze_vision_projection = True
    trainable = {n.split(".")[0] for n, p in provider.provide().named_parameters() if p.requires_grad}
    assert trainable == {"language_model"}
    provider.freeze_vision_model = provider.freeze_vision_projection = False
    provider.freeze_language_model = True
    trainable = {n.split(".")[0] for n, p in provider.provide().named_parameters() if p.requires_grad}
    assert trainable == {"vision_tower", "embed_vision"}
    provider.vision_config = dict(provider.vision_config, num_key_value_heads=3)
    with pytest.raises(ConfigError, match=r"model\.vision_config\.num_attention_heads=2 is not a multiple of "
                                          r"num_key_value_heads=3"):
        provider.finalize()
