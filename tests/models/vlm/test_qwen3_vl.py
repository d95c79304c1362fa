"""Qwen3-VL against transformers (a tiny random model and its image/video processors made here): logits on a
prompt with two images of different sizes and on a short video, DeepStack (dropped or moved features change
them), bit-identical export with the processor files, greedy generation with an image (library and
``longspan generate --image``), and the bad inputs."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from longspan import AutoBridge
from longspan.cli import main
from longspan.core.errors import DataError, NotSupportedError
from longspan.data.tokenizers import NullTokenizer
from longspan.inference import generate
from longspan.inference.images import load_images
from tests.helpers.vlm import assert_export_bit_identical, hf_greedy_ids
from tests.models.vlm.qwen3_vl_fixtures import PROMPT, make_qwen3_vl
from tests.models.vlm.qwen_vl_fixtures import (VOCAB, assert_logits_equal_transformers, draw_image,
                                               image_inputs, processed)

NEW_TOKENS = 5


@pytest.fixture(scope="module")
def qwen3_vl(tmp_path_factory):
    """(HF directory, transformers model, processed two-image inputs, longspan model imported from the directory)."""
    directory = tmp_path_factory.mktemp("qwen3_vl")
    hf = make_qwen3_vl(directory)
    inputs = processed(directory, PROMPT, [draw_image(64, 64, seed=1), draw_image(96, 32, seed=2)])
    model = AutoBridge.from_hf_pretrained(directory).to_megatron_model()[0].eval()
    return directory, hf, inputs, model


def test_logits_equal_transformers_on_two_images(qwen3_vl):
    _, hf, inputs, model = qwen3_vl
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 4], [1, 2, 6]]
    assert_logits_equal_transformers(hf, model, inputs, atol=1e-4)


def test_deepstack_features_dropped_or_moved_change_the_logits(qwen3_vl):
    """The parity above fails when DeepStack is dropped or its features go to other layers."""
    _, hf, inputs, model = qwen3_vl
    with torch.no_grad():
        expected = hf(**inputs).logits
    layers = model.language_model.decoder.layers
    kept = list(model.deepstack_hooks)
    try:
        for handle in kept:
            handle.remove()
        with torch.no_grad():
            dropped = model(inputs["input_ids"], **image_inputs(inputs))
        moved = [layers[str(i + 1)].register_forward_hook(model.deepstack_hook(i)) for i in model.deepstack_layers]
        with torch.no_grad():
            shifted = model(inputs["input_ids"], **image_inputs(inputs))
        for handle in moved:
            handle.remove()
    finally:
        model.deepstack_hooks = [layers[str(i)].register_forward_hook(model.deepstack_hook(i))
                                 for i in model.deepstack_layers]
    assert (dropped - expected).abs().max() > 1e-2
    assert (shifted - expected).abs().max() > 1e-2
    with torch.no_grad():
        torch.testing.assert_close(model(inputs["input_ids"], **image_inputs(inputs)), expected, rtol=0, atol=1e-4)


def test_export_is_bit_identical_with_the_processor_files(qwen3_vl, tmp_path):
    directory, _, _, model = qwen3_vl
    AutoBridge.from_hf_pretrained(directory).save_hf_pretrained(model, tmp_path)
    assert_export_bit_identical(directory, tmp_path, ("preprocessor_config.json", "chat_template.jinja",
                                                     "tokenizer.json", "tokenizer_config.json"))


def test_greedy_generate_with_images_equals_transformers(qwen3_vl):
    _, hf, inputs, model = qwen3_vl
    prompt = inputs["input_ids"]
    expected = hf_greedy_ids(hf, inputs, NEW_TOKENS)
    result = generate(model, NullTokenizer(VOCAB - 1), prompt[0].tolist(), max_new_tokens=NEW_TOKENS,
                      eos_ids=(), use_cache=True, model_inputs=image_inputs(inputs))
    assert result.output_ids == expected


def test_generate_cli_with_an_image(qwen3_vl, tmp_path, capsys):
    directory, hf, _, _ = qwen3_vl
    image = tmp_path / "picture.png"
    draw_image(96, 32, seed=2).save(image)
    prompt = "describe <|image_pad|> what colour"
    capsys.readouterr()
    code = main(["generate", "--hf-model", str(directory), "--image", str(image), "--prompt", prompt,
                 "--max-new-tokens", str(NEW_TOKENS), "--json"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    inputs = processed(directory, prompt, load_images([image]))
    assert result["prompt_ids"] == inputs["input_ids"][0].tolist()
    out = hf.generate(**inputs, attention_mask=torch.ones_like(inputs["input_ids"]), do_sample=False,
                      max_new_tokens=NEW_TOKENS)
    assert result["output_ids"] == out[0, inputs["input_ids"].shape[1]:].tolist()


def _video_prompt(directory, with_image: bool):
    """A prompt with (an image and) a two-frame-group video as the processor writes it: each temporal patch after
    its timestamp text, between ``<|vision_start|>`` and ``<|vision_end|>``; random patch pixels (the video
    processor needs torchvision)."""
    tok = transformers.AutoTokenizer.from_pretrained(str(directory))
    grid = torch.tensor([[2, 4, 4]])  # 4 frames = 2 temporal patches of 4x4 patches: 4 tokens per frame group
    frame = " <|vision_start|> " + " ".join(["<|video_pad|>"] * 4) + " <|vision_end|> "
    text = "describe" + (" <|vision_start|> <|image_pad|> <|vision_end|> and" if with_image else "")
    text += " one" + frame + "two" + frame + "what colour"
    images = [draw_image(64, 64, seed=3)] if with_image else []
    inputs = processed(directory, text, images) if with_image else {"input_ids": torch.tensor([tok(text)["input_ids"]])}
    ids = inputs["input_ids"]
    config = AutoBridge.from_hf_pretrained(directory).hf_config
    video = {"pixel_values_videos": torch.randn(2 * 16, 3 * 2 * 16 * 16, generator=torch.Generator().manual_seed(4)),
             "video_grid_thw": grid}
    kinds = (ids == config["image_token_id"]).int() + 2 * (ids == config["video_token_id"]).int()
    return {**inputs, **video, "mm_token_type_ids": kinds}


def test_logits_equal_transformers_on_a_video_with_and_without_an_image(qwen3_vl):
    directory, hf, _, model = qwen3_vl
    for with_image in (False, True):
        inputs = _video_prompt(directory, with_image)
        ours_inputs = {k: v for k, v in inputs.items() if k not in ("input_ids", "mm_token_type_ids")}
        with torch.no_grad():
            expected = hf(**inputs).logits
            ours = model(inputs["input_ids"], **ours_inputs)
            still = model(inputs["input_ids"], **dict(ours_inputs, pixel_values_videos=torch.zeros_like(
                inputs["pixel_values_videos"])))
        torch.testing.assert_close(ours, expected, rtol=0, atol=1e-4)
        assert (still - ours).abs().max() > 1e-2  # the video reaches the logits


def test_bad_vision_inputs_are_one_line_errors(qwen3_vl):
    directory, _, _, model = qwen3_vl
    inputs = _video_prompt(directory, with_image=False)
    ids = inputs["input_ids"][0].tolist()
    video_id = model.config.video_token_id
    last = max(i for i, t in enumerate(ids) if t == video_id)
    short = torch.tensor([ids[:last] + ids[last + 1:]])  # the second frame group lacks one of its 4 tokens
    with pytest.raises(DataError, match="needs 4 image tokens, the prompt has 3"):
        model(short, pixel_values_videos=inputs["pixel_values_videos"], video_grid_thw=inputs["video_grid_thw"])
    with pytest.raises(DataError, match="pixel_values_videos came without video_grid_thw"):
        model(inputs["input_ids"], pixel_values_videos=inputs["pixel_values_videos"])


def test_greedy_generate_with_a_video_equals_transformers(qwen3_vl):
    """The prompt's positions run on after the video by its rope deltas (kept on the KV cache)."""
    directory, hf, _, model = qwen3_vl
    inputs = _video_prompt(directory, with_image=True)
    prompt = inputs["input_ids"]
    expected = hf_greedy_ids(hf, inputs, NEW_TOKENS)
    extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "mm_token_type_ids")}
    result = generate(model, NullTokenizer(VOCAB - 1), prompt[0].tolist(), max_new_tokens=NEW_TOKENS, eos_ids=(),
                      use_cache=True, model_inputs=extra)
    assert result.output_ids == expected


def test_freeze_options_stop_their_parts_and_unserved_layouts_are_refused(qwen3_vl):
    """Each freeze option freezes its part (the projection: the merger and the DeepStack mergers); layouts the
    DeepStack hooks do not serve yet are one-line errors when the model is built."""
    directory, _, _, _ = qwen3_vl
    for flag, parts in (("freeze_language_model", {"language_model"}), ("freeze_vision_model", {"vision"}),
                        ("freeze_vision_projection", {"merger", "deepstack_mergers"})):
        provider = AutoBridge.from_hf_pretrained(directory).to_megatron_provider()
        setattr(provider, flag, True)
        built = provider.provide_meta()
        frozen = {name.split(".")[0] for name, p in built.named_parameters() if not p.requires_grad}
        trained = {name.split(".")[0] for name, p in built.named_parameters() if p.requires_grad}
        assert frozen == parts and not parts & trained, flag
    for field, value, message in (("recompute_granularity", "full", "recompute_granularity='full'"),):
        provider = AutoBridge.from_hf_pretrained(directory).to_megatron_provider()
        setattr(provider, field, value)
        with pytest.raises(NotSupportedError, match=message) as info:
            provider.provide_meta()
        assert "\n" not in str(info.value)
    provider = AutoBridge.from_hf_pretrained(directory).to_megatron_provider()
    assert provider.provide_meta(layer_numbers=[0, 1], post_process=False).deepstack_hooks
    with pytest.raises(NotSupportedError, match="DeepStack layers \\[0, 1\\] off the first stage"):
        provider.provide_meta(layer_numbers=[0], post_process=False)
    with pytest.raises(NotSupportedError, match="off the first stage"):
        provider.provide_meta(pre_process=False, layer_numbers=[1, 2])


def test_bridge_run_configs_name_the_providers():
    from longspan.config.targets import resolve_class
    from longspan.models import Qwen3VLModelProvider, Qwen3VLMoEModelProvider

    for name, cls in (("megatron.bridge.models.qwen_3_vl.provider.Qwen3VLModelProvider", Qwen3VLModelProvider),
                      ("megatron.bridge.models.Qwen3VLMoEModelProvider", Qwen3VLMoEModelProvider)):
        assert resolve_class(name, "model._target_") is cls
