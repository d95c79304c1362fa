"""Qwen3-VL with experts (``Qwen3VLMoeForConditionalGeneration``, a tiny random model made here) against
transformers: logits on a prompt with two images of different sizes, bit-identical export (the stacked experts
split and restacked) with the processor files."""

from __future__ import annotations

import torch

from longspan import AutoBridge
from tests.conversion.parity import tensors
from tests.helpers.vlm import assert_export_bit_identical
from tests.models.vlm.qwen3_vl_fixtures import PROMPT, make_qwen3_vl
from tests.models.vlm.qwen_vl_fixtures import draw_image, image_inputs, processed


def test_logits_and_export_equal_transformers(tmp_path):
    directory = tmp_path / "hf"
    hf = make_qwen3_vl(directory, moe=True)
    inputs = processed(directory, PROMPT, [draw_image(64, 64, seed=1), draw_image(96, 32, seed=2)])
    bridge = AutoBridge.from_hf_pretrained(directory)
    model = bridge.to_megatron_model()[0].eval()
    assert model.config.num_moe_experts == 4 and model.config.moe_layer_freq == [1, 0, 1]
    with torch.no_grad():
        expected = hf(**inputs).logits
        ours = model(inputs["input_ids"], **image_inputs(inputs))
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-4)

    bridge.save_hf_pretrained(model, tmp_path / "out")
    assert_export_bit_identical(directory, tmp_path / "out", ("preprocessor_config.json", "chat_template.jinja",
                                                             "tokenizer.json"))


def test_the_hubs_transposed_experts_load_and_export_as_they_were(tmp_path):
    """The released checkpoints (written by transformers 4.x) hold each expert's matrices transposed: they import
    to the same logits and export bit-identically in their own layout."""
    import json

    from safetensors.torch import load_file, save_file

    directory = tmp_path / "hf"
    hf = make_qwen3_vl(directory, moe=True)
    state = load_file(str(directory / "model.safetensors"))
    state = {k: (v.transpose(1, 2).contiguous() if ".experts." in k else v) for k, v in state.items()}
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(dict(config, transformers_version="4.57.0")))
    inputs = processed(directory, PROMPT, [draw_image(64, 64, seed=1), draw_image(96, 32, seed=2)])
    bridge = AutoBridge.from_hf_pretrained(directory)
    model = bridge.to_megatron_model()[0].eval()
    with torch.no_grad():
        ours = model(inputs["input_ids"], **image_inputs(inputs))
        torch.testing.assert_close(ours, hf(**inputs).logits, rtol=0, atol=1e-4)
    bridge.save_hf_pretrained(model, tmp_path / "out")
    exported = tensors(tmp_path / "out")
    assert sorted(exported) == sorted(state)
    assert all(torch.equal(exported[name], tensor) for name, tensor in state.items())
