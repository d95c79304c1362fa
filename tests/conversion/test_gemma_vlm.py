"""Gemma 3's vision-language model (Gemma3ForConditionalGeneration) through AutoBridge: logits on a prompt with two
images equal transformers' (fp32, 1e-5; the sliding window cuts inside an image, whose tokens see each other both
ways), import -> export is bit-identical with the processor files copied, greedy generation with an image equals
transformers' ``generate``, and bad images / image-token counts are one-line errors."""

from __future__ import annotations


import pytest
import torch
import transformers
from safetensors.torch import save_file

from longspan import AutoBridge
from longspan.core.errors import ConfigError, DataError
from longspan.inference.image_generation import generate_from_hf_with_images, generate_with_images, prompt_inputs
from tests.conversion.gemma_vlm_models import draw_image, make_gemma3_vlm
from tests.helpers.vlm import (assert_export_bit_identical, assert_provider_export_reads_back, assert_same_config_json,
                               hf_greedy_ids)
from tests.training.pretrain_helpers import small_config

PROMPT = "describe <start_of_image> the picture and <start_of_image> a dot"
WINDOW = 3  # shorter than an image's 4 tokens: the window's far edge cuts inside an image


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """(directory, transformers model, processor, processor inputs of PROMPT with two images, longspan model)."""
    src = tmp_path_factory.mktemp("gemma3_vlm")
    hf, processor = make_gemma3_vlm(src, window=WINDOW)
    inputs = processor(text=PROMPT, images=[draw_image(0), draw_image(1)], return_tensors="pt")
    bridge = AutoBridge.from_hf_pretrained(src)
    model = bridge.to_megatron_model()[0].eval()
    return src, hf, processor, inputs, bridge, model


def _ours(model, inputs, **overrides):
    kwargs = dict(pixel_values=inputs["pixel_values"], token_type_ids=inputs["token_type_ids"])
    kwargs.update(overrides)
    with torch.no_grad():
        return model(inputs["input_ids"], **kwargs)


def test_logits_with_two_images_equal_transformers(vlm):
    _, hf, _, inputs, _, model = vlm
    assert inputs["pixel_values"].shape[0] == 2 and int(inputs["token_type_ids"].sum()) == 8
    with torch.no_grad():
        reference = hf(**inputs).logits
    ours = _ours(model, inputs)
    assert (ours - reference).abs().max().item() <= 1e-5
    # Each piece matters: causal attention over the image tokens, or no images, give other logits.
    assert (_ours(model, inputs, token_type_ids=None) - reference).abs().max().item() > 1e-3
    assert (_ours(model, inputs, pixel_values=None) - reference).abs().max().item() > 1e-3
    # The per-token loss with labels is the cross-entropy of those logits.
    labels = inputs["input_ids"].roll(-1, dims=1)
    loss = _ours(model, inputs, labels=labels)
    expected = torch.nn.functional.cross_entropy(reference[0], labels[0], reduction="none")
    assert (loss[0] - expected).abs().max().item() <= 1e-5


def test_pooled_images_and_deeper_encoder_equal_transformers(tmp_path):
    """One soft token per image (2x2 patches average-pooled) and two encoder layers."""
    hf, processor = make_gemma3_vlm(tmp_path, seed=1, tokens_per_image=1, vision_layers=2)
    inputs = processor(text=PROMPT, images=[draw_image(2), draw_image(1)], return_tensors="pt")
    model = AutoBridge.from_hf_pretrained(tmp_path).to_megatron_model()[0].eval()
    with torch.no_grad():
        reference = hf(**inputs).logits
    assert (_ours(model, inputs) - reference).abs().max().item() <= 1e-5


def test_import_export_is_bit_identical_with_the_processor_files(vlm, tmp_path):
    src, hf, _, inputs, bridge, model = vlm
    out = tmp_path / "out"
    bridge.save_hf_pretrained([model], out)
    original = assert_export_bit_identical(src, out, ("processor_config.json", "tokenizer.json",
                                                      "tokenizer_config.json", "chat_template.jinja"))
    assert any(k.startswith("vision_tower.") for k in original)
    assert_same_config_json(src, out)

    # The hub's files name the vision encoder vision_tower.vision_model.*: they load too.
    hub = tmp_path / "hub"
    hub.mkdir()
    for name in ("config.json",):
        (hub / name).write_bytes((src / name).read_bytes())
    save_file({k.replace("vision_tower.", "vision_tower.vision_model.", 1): v for k, v in original.items()},
              str(hub / "model.safetensors"))
    again = AutoBridge.from_hf_pretrained(hub).to_megatron_model()[0].eval()
    assert torch.equal(_ours(again, inputs), _ours(model, inputs))

    # A model built in longspan exports as Gemma3ForConditionalGeneration from its provider alone.
    assert_provider_export_reads_back(bridge, model, hf, inputs, tmp_path / "fresh",
                                      transformers.Gemma3ForConditionalGeneration, atol=1e-5)


def test_greedy_generate_with_an_image_equals_transformers(vlm, tmp_path):
    src, hf, processor, _, _, model = vlm
    image = tmp_path / "picture.png"
    draw_image(1).save(image)
    prompt = "describe <start_of_image> the"
    inputs = processor(text=prompt, images=[draw_image(1)], return_tensors="pt")
    expected = hf_greedy_ids(hf, inputs, 8)
    result = generate_with_images(model, processor, prompt, [image], max_new_tokens=8, eos_ids=())
    assert result.prompt_ids == inputs["input_ids"][0].tolist()
    assert result.output_ids == expected and len(expected) == 8
    # From the HF directory.
    again = generate_from_hf_with_images(src, prompt, [str(image)], max_new_tokens=8, eos_ids=())
    assert again.output_ids == expected
    # Without a KV cache: every forward re-runs the sequence; the image inputs cover the prompt only.
    ids, image_inputs = prompt_inputs(processor, prompt, [image])
    tokens = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(8):
            tokens = torch.cat([tokens, model(tokens, **image_inputs)[:, -1:].argmax(-1)], dim=1)
    assert tokens[0, len(ids):].tolist() == expected


def test_bad_images_and_image_token_counts_are_one_line_errors(vlm, tmp_path):
    src, _, processor, inputs, _, model = vlm
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not an image")
    cases = [
        (lambda: generate_with_images(model, processor, PROMPT, [tmp_path / "missing.png", broken]),
         DataError, "missing.png does not exist"),
        (lambda: generate_with_images(model, processor, PROMPT, [broken, broken]),
         DataError, "broken.png cannot be read as an image"),
        (lambda: generate_with_images(model, processor, PROMPT, [draw_image(0)]),
         DataError, "the prompt has 2 image marker"),
        (lambda: _ours(model, inputs, pixel_values=inputs["pixel_values"][:1]),
         DataError, "8 image tokens .* for 1 image"),
        (lambda: _ours(model, inputs, pixel_values=inputs["pixel_values"][:, :, :14]),
         DataError, "pixel_values has shape"),
    ]
    for call, error, message in cases:
        with pytest.raises(error, match=message) as info:
            call()
        assert "\n" not in str(info.value)


def test_checkpoint_import_and_export_are_bit_identical(vlm, tmp_path):
    """import_ckpt writes a longspan checkpoint (run_config.yaml names Gemma3VLModelProvider); export_ckpt
    writes the source's tensors and config.json back."""
    src = vlm[0]
    AutoBridge.import_ckpt(src, tmp_path / "ckpt")
    assert "Gemma3VLModelProvider" in (tmp_path / "ckpt" / "iter_0000000" / "run_config.yaml").read_text()
    AutoBridge.export_checkpoint(tmp_path / "ckpt", tmp_path / "hf")
    assert_export_bit_identical(src, tmp_path / "hf", ("processor_config.json", "chat_template.jinja",
                                                       "tokenizer.json"))
    assert_same_config_json(src, tmp_path / "hf")


def test_provider_freezes_parts_and_checks_its_image_fields(vlm, tmp_path):
    bridge = vlm[4]
    provider = bridge.to_megatron_provider()
    provider.freeze_vision_model = provider.freeze_vision_projection = True
    model = provider.provide()
    trainable = {n.split(".")[0] for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {"language_model"}
    provider.freeze_vision_model = provider.freeze_vision_projection = False
    provider.freeze_language_model = True
    trainable = {n.split(".")[0] for n, p in provider.provide().named_parameters() if p.requires_grad}
    assert trainable == {"vision_tower", "multi_modal_projector"}

    provider.mm_tokens_per_image = 2
    with pytest.raises(ConfigError, match="mm_tokens_per_image=2 is invalid"):
        provider.provide()
    # validate() runs the same rule on a run's configuration.
    cfg = small_config(tmp_path)
    cfg.dataset.sequence_length = provider.seq_length
    cfg.model = provider
    with pytest.raises(ConfigError, match="mm_tokens_per_image=2 is invalid") as info:
        cfg.validate()
    assert "\n" not in str(info.value)
