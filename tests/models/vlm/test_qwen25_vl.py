"""Qwen2.5-VL against transformers: logits on a prompt with two images of different sizes, mRoPE position ids,
bit-identical export, greedy generation with an image (library and ``longspan generate --image``), and the bad
inputs (image tokens that do not match the images, images for a text-only model, missing or unreadable files)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from longspan import AutoBridge
from longspan.cli import main
from longspan.core.errors import ConfigError, DataError, NotSupportedError
from longspan.data.tokenizers import NullTokenizer
from longspan.inference import generate
from longspan.inference.images import expand_image_tokens, load_images
from longspan.models.vlm.mrope import mrope_position_ids
from tests.helpers.vlm import assert_export_bit_identical, hf_greedy_ids
from tests.models.vlm.qwen_vl_fixtures import (VOCAB, assert_logits_equal_transformers, draw_image,
                                               image_inputs, make_qwen_vl, processed)

PROMPT = ("describe <|vision_start|> <|image_pad|> <|vision_end|> and <|vision_start|> <|image_pad|> "
          "<|vision_end|> what colour")
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def qwen_vl(tmp_path_factory):
    """(HF directory, transformers model, processed inputs, longspan model imported from the directory)."""
    directory = tmp_path_factory.mktemp("qwen_vl")
    hf = make_qwen_vl(directory)
    hf.config._attn_implementation = "sdpa"
    # two images of different sizes: 2x2 and 1x3 merged patches (the second spans two attention windows)
    images = [draw_image(56, 56, seed=1), draw_image(84, 28, seed=2)]
    inputs = processed(directory, PROMPT, images)
    model = AutoBridge.from_hf_pretrained(directory).to_megatron_model()[0].eval()
    return directory, hf, inputs, model


def test_logits_equal_transformers_on_two_images(qwen_vl):
    _, hf, inputs, model = qwen_vl
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 4], [1, 2, 6]]
    assert_logits_equal_transformers(hf, model, inputs, atol=1e-5)


def test_mrope_positions_equal_get_rope_index(qwen_vl):
    directory, hf, _, _ = qwen_vl
    # a batch of two rows: images in different places, one row text-only
    a = processed(directory, "one <|vision_start|> <|image_pad|> <|vision_end|> two", [draw_image(56, 84, 3)])
    b = processed(directory, "<|vision_start|> <|image_pad|> <|vision_end|> big dog", [draw_image(28, 56, 4)])
    width = max(a["input_ids"].shape[1], b["input_ids"].shape[1])
    pad = lambda t: torch.nn.functional.pad(t, (0, width - t.shape[1]))  # noqa: E731
    ids = torch.cat([pad(a["input_ids"]), pad(b["input_ids"])])
    grid = torch.cat([a["image_grid_thw"], b["image_grid_thw"]])
    expected, expected_deltas = hf.model.get_rope_index(ids, mm_token_type_ids=(ids == hf.config.image_token_id).int(),
                                                        image_grid_thw=grid)
    ours, deltas = mrope_position_ids(ids, grid, hf.config.image_token_id, spatial_merge_size=2)
    assert torch.equal(ours, expected) and torch.equal(deltas, expected_deltas)


def test_export_is_bit_identical_with_the_processor_files(qwen_vl, tmp_path):
    directory, _, _, model = qwen_vl
    AutoBridge.from_hf_pretrained(directory).save_hf_pretrained(model, tmp_path)
    assert_export_bit_identical(directory, tmp_path, ("preprocessor_config.json", "chat_template.jinja",
                                                     "tokenizer.json", "tokenizer_config.json"))
    read = lambda d: {k: v for k, v in transformers.AutoConfig.from_pretrained(d).to_dict().items()  # noqa: E731
                      if k != "_name_or_path"}
    assert read(tmp_path) == read(directory)


def test_greedy_generate_with_images_equals_transformers(qwen_vl):
    _, hf, inputs, model = qwen_vl
    prompt = inputs["input_ids"]
    expected = hf_greedy_ids(hf, inputs, NEW_TOKENS)
    for use_cache in (True, False):
        result = generate(model, NullTokenizer(VOCAB - 1), prompt[0].tolist(), max_new_tokens=NEW_TOKENS,
                          eos_ids=(), use_cache=use_cache, model_inputs=image_inputs(inputs))
        assert result.output_ids == expected, use_cache


def test_generate_cli_with_an_image(qwen_vl, tmp_path, capsys):
    directory, hf, _, _ = qwen_vl
    image = tmp_path / "picture.png"
    draw_image(84, 28, seed=2).save(image)
    prompt = "describe <|image_pad|> what colour"
    capsys.readouterr()
    code = main(["generate", "--hf-model", str(directory), "--image", str(image), "--prompt", prompt,
                 "--max-new-tokens", str(NEW_TOKENS), "--json"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    inputs = processed(directory, prompt, load_images([image]))
    assert result["prompt_ids"] == inputs["input_ids"][0].tolist()
    out = hf.generate(**inputs, attention_mask=torch.ones_like(inputs["input_ids"]), do_sample=False,
                      max_new_tokens=NEW_TOKENS)  # stops at the end-of-sequence token, as the CLI does
    assert result["output_ids"] == out[0, inputs["input_ids"].shape[1]:].tolist()


def test_bad_images_and_image_tokens_are_one_line_errors(qwen_vl, tmp_path, capsys):
    directory, _, inputs, model = qwen_vl
    ids = inputs["input_ids"][0].tolist()
    last = max(i for i, t in enumerate(ids) if t == model.config.image_token_id)
    short = torch.tensor([ids[:last] + ids[last + 1:]])  # the second image lacks one of its 3 tokens
    with pytest.raises(DataError, match="row 0: image 1 .* needs 3 image tokens, the prompt has 2"):
        model(short, **image_inputs(inputs))
    with pytest.raises(DataError, match="2 image tokens.*for 1 images"):
        mark = model.config.image_token_id
        expand_image_tokens([1, mark, 2, mark], inputs["image_grid_thw"][:1], model.config)
    unreadable = tmp_path / "notes.png"
    unreadable.write_text("not a picture")
    for path, reason in ((tmp_path / "missing.png", "does not exist"), (unreadable, "cannot be read as an image")):
        capsys.readouterr()
        code = main(["generate", "--hf-model", str(directory), "--image", str(path), "--prompt", "a"])
        err = capsys.readouterr().err.strip()
        assert code == 2 and reason in err and str(path) in err and "\n" not in err


def test_an_image_for_a_text_only_model_is_refused(tmp_path, capsys):
    from tests.conversion.hf_models import make_hf_model

    make_hf_model("qwen2", tmp_path / "text")
    image = tmp_path / "picture.png"
    draw_image(28, 28, seed=0).save(image)
    capsys.readouterr()
    code = main(["generate", "--hf-model", str(tmp_path / "text"), "--image", str(image), "--prompt", "the"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "text-only model" in err and "\n" not in err
    with pytest.raises(NotSupportedError, match="text-only"):
        model = AutoBridge.from_hf_pretrained(tmp_path / "text").to_megatron_model()
        generate(model, NullTokenizer(95), [1, 2], max_new_tokens=1, model_inputs={"pixel_values": torch.zeros(1)})


def test_checkpoint_round_trip_and_generate_from_it(qwen_vl, tmp_path, capsys):
    """HF -> longspan checkpoint -> HF is bit-identical with the processor files; ``generate --checkpoint
    --image`` finds the image processor in the checkpoint and equals ``--hf-model``."""
    directory, _, _, _ = qwen_vl
    AutoBridge.import_ckpt(directory, tmp_path / "ckpt")
    AutoBridge.export_checkpoint(tmp_path / "ckpt", tmp_path / "hf")
    assert_export_bit_identical(directory, tmp_path / "hf", ("preprocessor_config.json", "chat_template.jinja"))
    image = tmp_path / "picture.png"
    draw_image(56, 28, seed=5).save(image)
    outputs = []
    for source in (["--checkpoint", str(tmp_path / "ckpt")], ["--hf-model", str(directory)]):
        capsys.readouterr()
        assert main(["generate", *source, "--image", str(image), "--prompt", "what shape", "--max-new-tokens", "4",
                     "--json"]) == 0
        outputs.append(json.loads(capsys.readouterr().out))
    assert outputs[0] == outputs[1]


def test_a_provider_made_export_reads_back_in_transformers(qwen_vl, tmp_path):
    """The provider's config translation (no source config.json): transformers builds the same model from it."""
    directory, hf, inputs, model = qwen_vl
    bridge = AutoBridge.from_longspan_provider(model.config)
    assert bridge.family.architecture == "Qwen2_5_VLForConditionalGeneration"
    bridge.save_hf_pretrained(model, tmp_path)
    reloaded = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path).eval()
    for key in ("image_token_id", "vision_start_token_id", "vision_end_token_id", "video_token_id"):
        assert getattr(reloaded.config, key) == getattr(hf.config, key), key
    with torch.no_grad():
        assert torch.equal(reloaded(**inputs).logits, hf(**inputs).logits)


def test_the_hubs_flat_config_spelling_translates_alike(qwen_vl):
    """The hub's config.json keeps the text fields at the top and spells mRoPE as rope_scaling type 'mrope'."""
    from longspan.families.qwen_vl.hf import qwen25_vl_provider

    directory, _, _, _ = qwen_vl
    nested = json.loads((directory / "config.json").read_text())
    text = dict(nested["text_config"])
    params = text.pop("rope_parameters")
    flat = {k: v for k, v in nested.items() if k != "text_config"}
    flat.update(text, rope_theta=params["rope_theta"],
                rope_scaling={"type": "mrope", "mrope_section": params["mrope_section"]})
    assert qwen25_vl_provider(flat) == qwen25_vl_provider(nested)


def _rebuilt(directory, **fields):
    """The imported model rebuilt from its provider with ``fields`` changed, the HF weights loaded."""
    bridge = AutoBridge.from_hf_pretrained(directory)
    provider = bridge.to_megatron_provider()
    for name, value in fields.items():
        setattr(provider, name, value)
    model = provider.provide()
    bridge.load_weights_into([model])
    return model.eval()


def test_the_vlm_fields_change_the_model(qwen_vl):
    """mrope_section, image_token_id, vision_config and the freeze options each act on the model."""
    directory, _, inputs, model = qwen_vl
    with torch.no_grad():
        base = model(inputs["input_ids"], **image_inputs(inputs))
        other_sections = _rebuilt(directory, mrope_section=[1, 1, 2])(inputs["input_ids"], **image_inputs(inputs))
    assert (other_sections - base).abs().max() > 1e-3
    with pytest.raises(DataError, match="image tokens"):  # the image marks are other tokens now
        _rebuilt(directory, image_token_id=3)(inputs["input_ids"], **image_inputs(inputs))
    provider = AutoBridge.from_hf_pretrained(directory).to_megatron_provider()
    provider.mrope_section = [2, 2, 2]  # 6 frequency pairs for a head of 8 channels
    with pytest.raises(ConfigError, match=r"model.mrope_section=\[2, 2, 2\] .* summing to kv_channels / 2 = 4"):
        provider.provide_meta()
    provider.mrope_section = [2, 1, 1]
    provider.vision_config = dict(provider.vision_config, depth=3, fullatt_block_indexes=[2])
    assert len(provider.provide_meta().vision.blocks) == 3
    for flag, part in (("freeze_language_model", "language_model"), ("freeze_vision_model", "vision"),
                       ("freeze_vision_projection", "merger")):
        provider = AutoBridge.from_hf_pretrained(directory).to_megatron_provider()
        setattr(provider, flag, True)
        built = provider.provide_meta()
        frozen = {name.split(".")[0] for name, p in built.named_parameters() if not p.requires_grad}
        trained = {name.split(".")[0] for name, p in built.named_parameters() if p.requires_grad}
        assert frozen == {part} and part not in trained, flag
    # the training loss reaches the merger and the language model, not the frozen encoder
    frozen_vision = _rebuilt(directory, freeze_vision_model=True).train()
    ids = inputs["input_ids"]
    frozen_vision(ids, labels=ids.roll(-1, 1), **image_inputs(inputs)).mean().backward()
    grads = {name.split(".")[0]: p.grad for name, p in frozen_vision.named_parameters()}
    assert grads["vision"] is None and grads["merger"].abs().sum() > 0 and grads["language_model"].abs().sum() > 0


def test_settings_the_mrope_table_cannot_apply_are_one_line_errors(qwen_vl):
    """The language model's GPT rows that mRoPE's single table over kv_channels cannot honour are refused when
    the model is built (and by validate()), never left unapplied; a sliding window is built."""
    directory = qwen_vl[0]
    refused = {"multi_latent_attention": dict(multi_latent_attention=True, add_qkv_bias=False, q_lora_rank=8,
                                              kv_lora_rank=8, qk_head_dim=4, qk_pos_emb_head_dim=4, v_head_dim=4),
               "rotary_base": dict(rotary_base=[10000.0, 1000000.0]),
               "rope_dynamic_factor": dict(rope_dynamic_factor=2.0, rope_original_max_position_embeddings=8)}
    for name, fields in refused.items():
        provider = AutoBridge.from_hf_pretrained(directory).to_megatron_provider()
        for key, value in fields.items():
            setattr(provider, key, value)
        with pytest.raises(NotSupportedError, match=rf"model.{name}=.* is not supported with mRoPE") as info:
            provider.provide_meta()
        assert "\n" not in str(info.value)
    provider = AutoBridge.from_hf_pretrained(directory).to_megatron_provider()
    provider.window_size = (4, 0)
    assert provider.provide_meta().language_model.args.window_size == (4, 0)


def test_tied_bf16_model_round_trips_and_matches_transformers(tmp_path):
    """The 3B's shape (output layer tied to the embeddings) in bf16: the vision encoder keeps the dtype, the
    export is bit-identical, the logits stay close to transformers' in bf16."""
    hf = make_qwen_vl(tmp_path / "src", seed=1, tie=True, dtype=torch.bfloat16)
    model = AutoBridge.from_hf_pretrained(tmp_path / "src").to_megatron_model()[0].eval()
    assert model.language_model.output_layer is None
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    AutoBridge.from_hf_pretrained(tmp_path / "src").save_hf_pretrained(model, tmp_path / "out")
    assert "lm_head.weight" not in assert_export_bit_identical(tmp_path / "src", tmp_path / "out")
    inputs = processed(tmp_path / "src", "a <|image_pad|> b", [draw_image(56, 28, seed=6)])
    with torch.no_grad():
        expected = hf(**inputs).logits.float()
        ours = model(inputs["input_ids"], **image_inputs(inputs)).float()
    torch.testing.assert_close(ours, expected, rtol=0, atol=0.05 * expected.abs().max().item())


def test_bridge_run_configs_name_the_provider():
    """A Megatron Bridge run_config.yaml's Qwen2.5-VL provider loads as longspan's (not as a GPT provider)."""
    from longspan.config.targets import resolve_class
    from longspan.models import Qwen25VLModelProvider

    for target in ("megatron.bridge.models.qwen_vl.qwen25_vl_provider.Qwen25VLModelProvider",
                   "megatron.bridge.models.Qwen25VLModelProvider", "longspan.models.Qwen25VLModelProvider"):
        assert resolve_class(target, "model") is Qwen25VLModelProvider, target
